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
def tiny_llama_cache_dir(tmp_path_factory):
    """target.cache_dir holding builtin:tiny-llama (built once per session)."""
    from eagle3.targets.tiny import builtin_target_dir

    cache = tmp_path_factory.mktemp("train-targets")
    builtin_target_dir("llama", cache)
    return cache
