import pytest


@pytest.fixture(scope="session")
def tiny_llama_cache_dir(tiny_cache_dir, tiny_target_dir):
    """target.cache_dir holding builtin:tiny-llama (the session's shared build)."""
    tiny_target_dir("llama")
    return tiny_cache_dir
