import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models run far faster on one thread than fighting for the shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_llama_cache_dir(tiny_cache_dir, tiny_target_dir):
    """target.cache_dir holding builtin:tiny-llama (the session's shared build)."""
    tiny_target_dir("llama")
    return tiny_cache_dir
