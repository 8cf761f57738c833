import math, pickle
import pytest, torch
from mixedprec.scaler import LossScaler, ScalingError

@pytest.mark.parametrize("k", [1, 2, 5])
def test_doubles_after_exactly_k_clean_steps(k):
    sc = LossScaler(loss_scale=8., max_noskip=k)
    for i in range(k - 1):
        sc.update(False)
        assert sc.scale == 8.
    sc.update(False)
    assert sc.scale == 16. and sc.noskip == 0

def test_overflow_resets_counter_and_halves():
    sc = LossScaler(loss_scale=8., max_noskip=3)
    sc.update(False); sc.update(False); sc.update(True)
    assert (sc.scale, sc.noskip, sc.skipped) == (4., 0, True)
    sc.update(False); sc.update(False)
    assert sc.scale == 4.
    sc.update(False)
    assert sc.scale == 8.

def test_cap_and_floor():
    sc = LossScaler(loss_scale=2.**20, max_noskip=1, max_scale=2.**22)
    for _ in range(10): sc.update(False)
    assert sc.scale == 2.**22
    sc = LossScaler(loss_scale=4., min_scale=0.5, max_overflow_at_min=100)
    for _ in range(20): sc.update(True)
    assert sc.scale == 0.5 and sc.scale > 0

def test_static_is_constant_but_still_skips():
    sc = LossScaler(dynamic=False)
    assert sc.scale == 512.
    for inf in (True, False) * 1500: assert sc.update(inf) is inf
    assert sc.scale == 512.

def test_defaults_follow_design():
    assert LossScaler().scale == 2.**16
    assert LossScaler(dynamic=False).scale == 512.
    assert LossScaler(loss_scale=3.).scale == 3.

def test_nonfinite_loss_keeps_scale_and_counts():
    sc = LossScaler(loss_scale=64., max_bad_loss=3)
    for _ in range(2): assert sc.update(True, reason='nonfinite_loss')
    assert sc.scale == 64. and sc.hopeless() is None
    sc.update(True, reason='nonfinite_loss')
    assert 'forward pass or the data' in sc.hopeless()
    sc.update(False)
    assert sc.hopeless() is None

def test_hopeless_at_floor():
    sc = LossScaler(loss_scale=1., max_overflow_at_min=2)
    sc.update(True); assert sc.hopeless() is None
    sc.update(True); assert 'minimum loss scale' in sc.hopeless()

@pytest.mark.parametrize("kw,msg", [(dict(loss_scale=0.), 'loss_scale'), (dict(loss_scale=float('inf')), 'loss_scale'),
    (dict(loss_scale=-1.), 'loss_scale'), (dict(max_scale=10., loss_scale=100.), 'max_scale'),
        (dict(min_scale=0.), 'min_scale'),
    (dict(min_scale=10., loss_scale=2.), 'min_scale'), (dict(max_noskip=0), 'max_noskip'), (dict(factor=1.), 'factor'),
    (dict(max_bad_loss=0), 'max_bad_loss')])
def test_bad_settings_raise(kw, msg):
    with pytest.raises(ValueError, match=msg): LossScaler(**kw)

def test_state_dict_round_trip_is_plain_and_weights_only(tmp_path):
    a = LossScaler(loss_scale=3., max_noskip=2, min_scale=0.25)
    a.update(False); a.update(True); a.update(False)
    sd = a.state_dict()
    assert all(isinstance(v, (int, float, bool)) for v in sd.values())
    torch.save(sd, tmp_path/'s.pt')
    b = LossScaler().load_state_dict(torch.load(tmp_path/'s.pt', weights_only=True))
    assert b.state_dict() == sd
    with pytest.raises(KeyError, match='missing'): LossScaler().load_state_dict({})

def test_deepspeed_style_sequence():
    # DeepSpeed test_dynamic_loss_scale, window 2 under our window-th growth: 2 overflows /4, 2 clean x2, 1 overflow /2
    sc = LossScaler(loss_scale=2.**8, max_noskip=2)
    sc.update(True); sc.update(True)
    assert sc.scale == 2.**6
    sc.update(False); sc.update(False)
    assert sc.scale == 2.**7
    sc.update(True)
    assert sc.scale == 2.**6

def test_history_records_scale_used_and_reason():
    sc = LossScaler(loss_scale=8., max_noskip=1, history_size=3)
    sc.update(False); sc.update(True, reason='nonfinite_norm', grad_norm=float('inf'))
    assert [(r.scale, r.skipped, r.reason) for r in sc.history] == [(8., False, None), (16., True, 'nonfinite_norm')]
    for _ in range(5): sc.update(False)
    assert len(sc.history) == 3
    pickle.loads(pickle.dumps(sc))

from hypothesis import given, settings, strategies as st

@settings(max_examples=200, deadline=None)
@given(flags=st.lists(st.sampled_from(['clean', 'overflow', 'bad_loss']), max_size=60), noskip=st.integers(1, 5),
       start=st.sampled_from([1., 4., 2.**16]), cap_exp=st.integers(0, 4))
def test_scaler_follows_the_design_rules_for_any_sequence(flags, noskip, start, cap_exp):
    "A direct model of nbs/DESIGN.md's rules agrees with LossScaler on every prefix of any step sequence"
    max_scale, min_scale = start * 2.**cap_exp, 1.
    sc = LossScaler(loss_scale=start, max_noskip=noskip, max_scale=max_scale, min_scale=min_scale,
                    max_overflow_at_min=10**6, max_bad_loss=10**6)
    scale, clean = start, 0
    for f in flags:
        skipped = sc.update(f != 'clean', reason='nonfinite_loss' if f == 'bad_loss' else 'overflow')
        if f == 'overflow': scale, clean = max(scale / 2, min_scale), 0
        elif f == 'clean':
            clean += 1
            if clean == noskip: scale, clean = min(scale * 2, max_scale), 0
        assert skipped == (f != 'clean') and sc.scale == scale and min_scale <= sc.scale <= max_scale and sc.scale > 0
    assert sc.n_skipped == sum(f != 'clean' for f in flags) and sc.n_steps == len(flags)

from mixedprec.scaler import CODES

@settings(max_examples=150, deadline=None)
@given(codes=st.lists(st.sampled_from([0, 0, 0, 1, 2, 3]), max_size=40), noskip=st.integers(1, 4),
       dynamic=st.booleans(),
       start=st.sampled_from([1., 3., 2.**16]), factor=st.sampled_from([2., 1.5, 3.]), cap_exp=st.integers(0, 3))
def test_the_tensor_rules_follow_a_direct_model_for_any_sequence(codes, noskip, dynamic, start, factor, cap_exp):
    ("`advance` (the one rule engine, tensor ops) against a direct Python model of nbs/DESIGN.md's rules: scale, the "
     "scale each step reads, counters, history")
    max_scale, min_scale = start * factor ** cap_exp, 1.
    sc = LossScaler(loss_scale=start, dynamic=dynamic, max_noskip=noskip, max_scale=max_scale, factor=factor,
                    max_overflow_at_min=10**6, max_bad_loss=10**6)
    scale, clean, history = start, 0, []
    for i, c in enumerate(codes):
        s, inv = sc.tensors('cpu')                       # the scale this step reads
        assert s.item() == float(torch.tensor(scale, dtype=torch.float32)) and inv.item() == float(torch.tensor(1 / scale, dtype=torch.float32))
        found = sc.advance(torch.tensor(c), grad_norm=torch.tensor(1.5))
        history.append((i + 1, scale, c != 0, CODES[c] if c else None, 1.5 if c in (0, 3) else None))
        if c in (1, 3):
            clean = 0
            if dynamic: scale = max(scale / factor, min_scale)
        elif c == 0:
            clean += 1
            if dynamic and clean >= noskip: scale, clean = min(scale * factor, max_scale), 0
        assert bool(found) == (c != 0) and sc.scale == scale and sc.noskip == clean
    assert [(r.step, r.scale, r.skipped, r.reason, r.grad_norm) for r in sc.history] == history
    assert sc.n_skipped == sum(c != 0 for c in codes) and sc.n_steps == len(codes)

def test_hopeless_is_raised_when_the_host_takes_the_step_in():
    from mixedprec.scaler import GivenReasons
    sc = LossScaler(loss_scale=2., max_overflow_at_min=2)
    names = GivenReasons(params=['0.weight (inf)'])        # the scaler keeps none: the caller hands them to each drain
    for _ in range(2):
        sc.tensors('cpu'); sc.advance(torch.tensor(1), reasons=names)
    sc.tensors('cpu')
    with pytest.raises(ScalingError, match=r"minimum loss scale.*0\.weight \(inf\)"):
        sc.advance(torch.tensor(1), reasons=names)
    assert sc.history[-1].params == ('0.weight (inf)',) and sc.n_skipped == 3

def test_a_host_change_restarts_the_tensors():
    sc = LossScaler(loss_scale=8.)
    sc.tensors('cpu'); sc.advance(torch.tensor(1))          # 8 -> 4 in the tensors, taken in by the host's books
    assert sc.scale == 4. and sc.tensors('cpu')[0].item() == 4.
    sc.load_state_dict({**sc.state_dict(), 'scale': 64.})
    assert sc.tensors('cpu')[0].item() == 64.
    sc.scale = 2.
    assert sc.tensors('cpu')[1].item() == 0.5
    with pytest.raises(RuntimeError, match='tensors'):
        LossScaler().advance(torch.tensor(0))

def test_construction_and_a_loaded_state_follow_one_rule_set():
    # check_scaler_settings serves both: what a loaded state may not hold, a new scaler may not be built with
    with pytest.raises(ValueError, match='factor must be finite and > 1'): LossScaler(factor=float('inf'))
    with pytest.raises(ValueError, match=r'min_scale \(4.0\) is above max_scale \(2.0\)'):
        LossScaler(loss_scale=1., dynamic=False, min_scale=4., max_scale=2.)
    sc = LossScaler(2.**8)
    for bad in (dict(factor=float('inf')), dict(min_scale=4., max_scale=2.)):
        with pytest.raises(ValueError, match='out of range.*nothing was loaded'):
            sc.load_state_dict({**sc.state_dict(), **bad})

@pytest.mark.parametrize("dynamic", [True, False])
def test_the_rule_on_the_host_and_as_tensor_ops_moves_alike(dynamic):
    "The CPU takes the rule in host numbers, a GPU as tensor ops: the same scale, count and books over any outcomes"
    from mixedprec.scaler import ScaleRule
    def rule(): return ScaleRule(2.**10, 0, 'cpu', dynamic, 2., 3, 2.**12, 2.**8)
    host, ops = rule(), rule()
    ops.on_host = False
    ops.scale64, ops.noskip = torch.tensor(ops.scale64, dtype=torch.float64), torch.tensor(ops.noskip)
    ops.refresh()
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 4, (400,), generator=g).tolist() + [0] * 20 + [1] * 8   # grows to the cap, falls to the floor
    for c in codes:
        norm = torch.rand((), generator=g)
        (s1, v1, _), (s2, v2, _) = host.advance(torch.tensor(c), norm), ops.advance(torch.tensor(c), norm)
        assert bool(s1) == bool(s2) == (c != 0)
        assert list(v1) == v2.tolist()
        assert torch.equal(host.scale, ops.scale) and torch.equal(host.inv, ops.inv)
    assert host.scale64 == (2.**8 if dynamic else 2.**10)
