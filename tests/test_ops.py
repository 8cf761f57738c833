import pytest, torch
from mixedprec import ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("dst_dtype", DTYPES)
@pytest.mark.parametrize("scale", [1., 0.25, 1/3, 2.**-16])
def test_scale_check_matches_definition(src_dtype, dst_dtype, scale):
    src = [torch.randn(n).to(src_dtype) for n in (1, 3, 1000)]
    dst = [torch.empty(n, dtype=dst_dtype) for n in (1, 3, 1000)]
    assert not ops.scale_check_(src, dst, scale).item()
    for s, d in zip(src, dst): torch.testing.assert_close(d, (s.float() * scale).to(dst_dtype), rtol=0, atol=0)

@pytest.mark.parametrize("bad", [float('inf'), -float('inf'), float('nan')])
@pytest.mark.parametrize("where", [0, -1, 17])
def test_scale_check_flags_any_nonfinite(bad, where):
    src = [torch.randn(50, dtype=torch.half) for _ in range(7)]
    src[3][where] = bad
    assert ops.scale_check_(src, [torch.empty(50) for _ in src], 0.5).item()

def test_scale_check_in_place_and_shapes():
    t = torch.tensor([[2., 4.]])
    ops.scale_check_([t], [t], 0.5)
    assert t.tolist() == [[1., 2.]]
    with pytest.raises(ValueError, match='same length'): ops.scale_check_([t], [], 1.)
    with pytest.raises(ValueError, match='same number'): ops.scale_check_([t], [torch.zeros(3)], 1.)
    assert not ops.scale_check_([], [], 1.).item()

def test_scale_check_writes_into_leaf_params():
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.half))
    ops.scale_check_([torch.ones(3)], [p], 1.)
    assert p.detach().tolist() == [1., 1., 1.]

def test_l2norm_matches_clip_grad_norm():
    ts = [torch.randn(n) for n in (1, 10, 333)]
    # bit for bit on fp32 master grads
    assert torch.equal(ops.l2norm(ts, impl='ref'), torch.nn.utils.get_total_norm(ts, 2.))
    ts.append(torch.randn(7).half())                                                # half tensors are reduced in fp32
    torch.testing.assert_close(ops.l2norm(ts), torch.cat([t.float() for t in ts]).norm())
    total, each = ops.l2norm(ts, per_tensor=True)
    torch.testing.assert_close(each, torch.stack([t.float().norm() for t in ts]))
    assert ops.l2norm(ts).dtype == torch.float32 and ops.l2norm(ts).dim() == 0

def test_backend_names_the_path():
    assert ops.backend(torch.zeros(1), impl='ref') == 'ref'
    assert ops.backend(torch.zeros(1)) == 'cpp'           # the C++ CPU kernels build on every machine we support
