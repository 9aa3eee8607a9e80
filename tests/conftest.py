"""The quick run and the full grid.

``python -m pytest -q`` is the run a contributor makes often (about 4 minutes on 2 cores): every
kernel is still compiled and its PTX checked for its stage's instructions, at head dim 128; the
other head dims and dtypes, and the builds of the knobs that were measured and left off, wait for
``--full-grid``, which CI runs. What the quick run leaves out is this one table.
"""

import re

# test (file::function) -> the case ids the quick run keeps (a regex searched in the id between
# the brackets; None: the whole test waits for the full grid).
QUICK = {
    "test_compile.py::test_compiles_with_stage_instructions": r"-d128-c1-bfloat16$",
    "test_compile.py::test_fp8_stages_run_both_gemms_in_e4m3": r"^128-",
    "test_compile.py::test_decode_split_has_a_pdl_combine": r"^128$",
    "test_compile.py::test_decode_merges_in_the_main_kernel": r"^128$",
    "test_compile.py::test_decode_prefetches_into_l2_before_the_pdl_wait": r"^128$",
    "test_compile.py::test_decode_claiming_takes_tiles_off_a_counter": r"^last_cta-128$",
    "test_compile.py::test_decode_on_a_paged_cache_looks_pages_up": r"-128$",
    "test_warp_specialized.py::test_registers_move_from_producer_to_consumers": r"-d128-bfloat16-c1$",
    "test_warp_specialized.py::test_k6_stores_o_per_warpgroup": r"^128$",
    "test_fp8_quant.py::test_per_tensor_quantizer_compiles_to_wide_loads_and_e4m3_conversions": r"^128$",
    "test_fp8_quant.py::test_k8s_three_quantizers_compile_into_one_kernel_without_spills": r"^128$",
    "test_fp8_quant.py::test_quantizer_kernel_compiles_to_e4m3_conversions_and_butterfly_shuffles": r"^128$",
    # issue 35's features: one build each in the quick run, the rest in the full grid
    "test_window.py::test_a_window_builds_with_its_lower_edge_loop": r"^k6-128-True-",
    "test_window.py::test_k10_takes_a_window_deterministic_too": r"^True-",
    "test_softcap.py::test_a_softcap_adds_one_tanh_per_score": r"^k6-128-True$",
    "test_softcap.py::test_k10s_softcap_backward_takes_one_tanh_a_score_and_overlaps_only_with_capped_overlap": r"^k10_fa3$",
    "test_varlen.py::test_the_packed_kernel_builds_without_a_tma_store_or_clusters": r"^128-True$",
    # measured and left off (docs/k6-runs.md): their builds are checked in the full grid
    "test_warp_specialized.py::test_cluster_multicasts_k_and_v_in_static_non_causal_builds_only": None,
    "test_warp_specialized.py::test_split_tail_is_a_static_non_causal_knob_with_atomics_and_no_spills": None,
    "test_warp_specialized.py::test_pin_pv_wait_is_checked_and_builds": None,
    "test_warp_specialized.py::test_k6_softmax_knobs_measured_and_left_off": None,
    "test_warp_specialized.py::test_k6_q_in_registers_measured_and_left_off": None,
}


def pytest_addoption(parser):
    parser.addoption("--full-grid", action="store_true",
                     help="every head dim, dtype and knob build (CI); without it, the quick run (tests/conftest.py)")


def in_quick_run(nodeid: str) -> bool:
    path, _, case = nodeid.partition("[")
    key = "::".join(path.split("/")[-1].split("::")[:2])
    if key not in QUICK:
        return True
    keep = QUICK[key]
    return keep is not None and bool(case) and re.search(keep, case.rstrip("]")) is not None


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full-grid"):
        return
    grid = [item for item in items if not in_quick_run(item.nodeid)]
    if grid:
        config.hook.pytest_deselected(items=grid)
        items[:] = [item for item in items if in_quick_run(item.nodeid)]
