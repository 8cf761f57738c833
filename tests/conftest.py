import random
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
