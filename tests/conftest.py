"""Suite-wide test settings: CPU only, 8 virtual CPU devices for sharding tests, and a
deterministic hypothesis profile (CI must never flake)."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

try:
    from hypothesis import HealthCheck, settings  # noqa: E402
except ImportError:  # a bare GPU image (benchmarks/gpu_check.sh skips the hypothesis-based files)
    settings = None

if settings is not None:
    settings.register_profile(
        "ci",
        derandomize=True,
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    settings.register_profile("dev", deadline=None, max_examples=200)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

try:  # device tests need 8 CPU devices; must be set before any backend initialises
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
except ImportError:  # the ledger alone needs no JAX
    pass

# JAX's persistent compilation cache (on wherever kvjax builds an engine): the suite writes it
# to one temporary directory, shared with the `kvjax` processes the tests start, never to ~/.cache
if not os.environ.get("KVJAX_COMPILATION_CACHE_DIR"):
    import atexit
    import shutil
    import tempfile

    _jax_cache = tempfile.mkdtemp(prefix="kvjax-test-jax-cache-")
    os.environ["KVJAX_COMPILATION_CACHE_DIR"] = _jax_cache
    atexit.register(shutil.rmtree, _jax_cache, ignore_errors=True)
