"""The quick run's table (tests/conftest.py) names tests that exist, and keeps what it says."""

import importlib

from conftest import QUICK, in_quick_run


def test_every_test_the_quick_run_trims_exists():
    for key in QUICK:
        path, func = key.split("::")
        module = importlib.import_module(path.removesuffix(".py"))
        assert callable(getattr(module, func, None)), key


def test_the_quick_run_keeps_d128_and_untrimmed_tests_and_drops_the_rest():
    stage = "tests/test_compile.py::test_compiles_with_stage_instructions"
    assert in_quick_run(f"{stage}[k6-d128-c1-bfloat16]")
    assert not in_quick_run(f"{stage}[k6-d64-c1-bfloat16]")
    assert not in_quick_run(f"{stage}[k6-d128-c1-float16]")
    assert not in_quick_run("tests/test_warp_specialized.py::test_pin_pv_wait_is_checked_and_builds")
    assert in_quick_run("tests/test_compile.py::test_k1_has_three_launches")
    assert in_quick_run("tests/test_decode.py::test_split_ranges_cover_every_tile_once[3-1]")
