import random
import numpy as np
import pytest
import torch

def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")

NEED_TEST_BUILDS = ('test_cuda_emulation.py::', 'test_fused.py::test_cuda_sources_compile_without_a_gpu')

def pytest_collection_modifyitems(config, items):
    # the tests that need the two test-only builds run last: `make test` compiles those in the background meanwhile
    # (tests/builds.py)
    items.sort(key=lambda item: any(k in item.nodeid for k in NEED_TEST_BUILDS))
    if torch.cuda.is_available(): return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "cuda" in item.keywords: item.add_marker(skip)

@pytest.fixture(autouse=True)
def seeded():
    random.seed(0); np.random.seed(0); torch.manual_seed(0)
    yield

from mixedprec.engine import settings        # the ops' impl and where the skip is decided, for a block

@pytest.fixture(params=['ref', 'fused'])
def impl(request):
    "Run a test with the reference ops, then with the fused kernels; yields the impl name"
    with settings(impl=request.param): yield request.param

def same_or_close(a, b, impl, rtol=1e-6, atol=1e-9):
    "Bit for bit with the reference ops; to fp32 rounding with the fused kernels, whose sums run in another order"
    if impl == 'ref': assert torch.equal(a, b), (a, b)
    else: torch.testing.assert_close(a, b, rtol=rtol, atol=atol)

@pytest.fixture(params=['host', 'device'])
def decide(request):
    "Run a test with the skip decided on the host, then on the device (which the CPU does too here); yields where"
    with settings(decide='never' if request.param == 'host' else 'always'): yield request.param
