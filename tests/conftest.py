import random
from contextlib import contextmanager
import numpy as np
import pytest
import torch

def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")

def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available(): return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "cuda" in item.keywords: item.add_marker(skip)

@pytest.fixture(autouse=True)
def seeded():
    random.seed(0); np.random.seed(0); torch.manual_seed(0)
    yield

@contextmanager
def mixedprec_settings(impl:str=None, decide:str=None):
    "Run a block with the ops' `impl` and/or the skip decided `decide` ('cuda', 'always', 'never'), restoring both after"
    from mixedprec import ops, master
    old_impl, old_decide = ops.DEFAULT_IMPL, master.DECIDE_ON_DEVICE
    try:
        if impl is not None: ops.set_impl(impl)
        if decide is not None: master.set_decide_on_device(decide)
        yield
    finally: ops.set_impl(old_impl); master.set_decide_on_device(old_decide)

@pytest.fixture(params=['ref', 'fused'])
def impl(request):
    "Run a test with the reference ops, then with the fused kernels; yields the impl name"
    with mixedprec_settings(impl=request.param): yield request.param

def same_or_close(a, b, impl, rtol=1e-6, atol=1e-9):
    "Bit for bit with the reference ops; to fp32 rounding with the fused kernels, whose sums run in another order"
    if impl == 'ref': assert torch.equal(a, b), (a, b)
    else: torch.testing.assert_close(a, b, rtol=rtol, atol=atol)

@pytest.fixture(params=['host', 'device'])
def decide(request):
    "Run a test with the skip decided on the host, then on the device (which the CPU does too here); yields where"
    with mixedprec_settings(decide='never' if request.param == 'host' else 'always'): yield request.param
