"""A pytest plugin (tests/conftest.py loads it): the slow tier, `SLOW` below and `@pytest.mark.slow`.

The README's test command (what CI runs) must finish inside CI's budget on 2 cores; the tests
marked `slow` are the long end-to-end rehearsals whose every part a faster test also covers at
a smaller scale (the pod rehearsed with chaos, the notebooks, whole models trained through the
GPU kernels' interpreter, ...). They skip, saying how to run them, unless pytest is given `--slow` (or
`BERT_JAX_SLOW=1` is set): `python -m pytest -q -n 2 tests --slow` runs everything,
`python -m pytest -q -n 2 tests --slow -m slow` the slow tier alone. Run it before a release
and after changing what those tests rehearse (bert_jax/pod/, bert_jax/checkpoints/, launch/).
"""

import os

import pytest

REASON = "the slow tier: run with --slow (or BERT_JAX_SLOW=1); tests/helpers/slow_tier.py"

# The slow tier, by test function ("file::name", every parameter of it): the most expensive tests of a
# full run with --durations (2026-12-07, 2-core AMD EPYC; benchmarks/RESULTS.md, "Where the test
# suite's CPU goes"), 58% of the suite's CPU, each beside a faster test of the same code.
SLOW = (
    # Whole runs rehearsed end to end; their parts have their own tests (tests/checkpoints, the local
    # kill -9 resume, tests/pod/test_supervisor*.py and test_launch.py, test_docs_walkthroughs.py):
    "tests/pod/test_pod_rehearsal.py::test_pod_runs_through_preemptions_crashes_and_a_chaos_of_faults_log_the_reference_losses",
    "tests/pretrain/test_pretrain.py::test_two_phases_resume_across_the_boundary",
    "tests/pretrain/test_pretrain.py::test_packing_dynamic_masking_and_the_ablations_train",
    "tests/pretrain/test_pretrain.py::test_a_changed_schedule_on_resume_and_a_zero_learning_rate_are_reported",
    "tests/pretrain/test_divergence.py::test_a_rollback_skips_what_a_skip_by_hand_skips_also_when_killed_before_the_next_save",
    "tests/docs/test_notebooks.py::test_pretrain_notebook",
    "tests/docs/test_notebooks.py::test_finetune_your_data_notebook",
    "tests/docs/test_notebooks.py::test_finetune_glue_notebook",
    "tests/docs/test_notebooks.py::test_fill_mask_and_features_notebook",
    "tests/finetune/test_finetune.py::test_main_second_run_loads_its_programs",
    "tests/finetune/test_finetune.py::test_programs_compiled_ahead_change_nothing_but_when_they_compile",
    "tests/finetune/test_finetune.py::test_fine_tuning_in_a_bucket_writes_what_a_local_run_writes",
    "tests/finetune/test_finetune_tasks.py::test_glue_task_end_to_end_from_files",
    "tests/training/test_training.py::test_data_fsdp_and_tensor_parallel_give_the_same_losses",
    "tests/model/test_modeling_options.py::test_sparse_last_layer_gives_the_same_logits_and_gradients",
    "tests/model/test_modeling_options.py::test_separate_qkv_matmuls_train_like_the_stacked_kernel",
    "tests/model/test_modeling_options.py::test_cudnn_dispatch_falls_back_to_xla_where_cudnn_refuses_a_training_shape",
    "tests/model/test_mixed_precision.py::test_every_matmul_of_each_fine_tuning_head_takes_bf16_and_returns_float32",
    "tests/data_pipeline/tasks/test_squad.py::test_squad_dev_sets_label_and_answer_like_google",  # ../shared/data only
    # TPU compiles (libtpu: 5-10 s a program); the tiny config's slice compile stays in the fast tier:
    "tests/pod/test_plan.py::test_plan_a_v5e_2x2_slice",
    "tests/pod/test_aot_tpu.py::test_fsdp_flops_count_the_collective_matmul_loops",
    "tests/pod/test_aot_tpu.py::test_dot_product_attention_compiles_to_the_pallas_splash_kernel",
    # GPU kernels through Pallas's interpreter on the CPU: whole models trained with them, and FP8's
    # casts (an H100/H200 feature); each kernel's value-and-gradient test stays in the fast tier:
    "tests/model/test_fused_per_shard.py::test_the_pretraining_model_with_the_kernels_on_a_mesh_has_one_device_s_gradients",
    "tests/model/test_fused_per_shard.py::test_the_kernels_run_per_shard_and_equal_one_device",
    "tests/model/test_fused.py::test_the_fused_model_trains_like_the_unfused_one",
    "tests/model/test_fused_qkv.py::test_the_model_with_the_kernels_trains_like_the_one_without",
    "tests/model/test_fused_qkv.py::test_the_benchmark_times_both_sides_and_writes_the_launch_shapes_it_swept",
    "tests/model/test_fused_ffn.py::test_the_model_with_the_kernels_trains_like_the_one_without",
    "tests/model/test_fused_fp8_chain.py::test_the_unrolled_fp8_model_trains_as_with_flax_s_casts_when_each_layer_s_kernel_casts_the_next_s_input",
    "tests/model/test_fused_fp8_chain.py::test_the_chained_model_s_hidden_states_are_each_layer_s_output",
    "tests/model/test_fused_fp8_chain.py::test_the_q_k_v_gemms_read_the_kernel_s_e4m3_copies_in_what_a_gpu_compiles",
    "tests/model/test_fused_fp8_chain.py::test_an_attention_reading_a_pending_ffn_end_trains_as_flax_s_einsums",
    "tests/model/test_fused_fp8.py::test_the_fp8_model_trains_as_with_flax_s_cast_when_the_kernel_casts",
    "tests/model/test_fused_fp8.py::test_the_kernel_casts_dh_to_e5m2_and_takes_its_amax_as_flax_does",
    "tests/model/test_fused_fp8.py::test_the_forward_kernel_casts_y_to_e4m3_and_takes_its_amax_as_flax_s_in_q_does",
    "tests/model/test_fused_fp8.py::test_a_sub_layer_with_dropout_trains_as_flax_s_fp8_dense_then_the_kernel",
    "tests/model/test_fp8.py::test_fp8_training_tracks_bf16_and_accumulation_advances_the_state_per_micro_batch",
    "tests/model/test_fp8.py::test_a_resumed_fp8_run_repeats_the_uninterrupted_one_bit_for_bit",
    "tests/model/test_fp8.py::test_the_train_step_carries_the_scaling_state_one_amax_per_step",
    "tests/model/test_fp8.py::test_scanned_layers_stack_the_state_and_the_config_file_leaves_fp8_out",
    # Benchmarks and studies run for real (their arithmetic is tested on its own):
    "tests/experiments/test_pretraining_helps.py::test_quick_pipeline_and_resume",
    "tests/experiments/test_modernbert_vs_bert.py::test_report_structure",
    "tests/experiments/test_modernbert_vs_bert.py::test_same_batches",
    "tests/experiments/test_modernbert_vs_bert.py::test_equal_flops_by_hand",
    "tests/experiments/test_modernbert_vs_bert.py::test_equal_parameters",
    "tests/benchmarks/test_step_benchmarks.py::test_bench_optimizer_variants_apply_the_same_update",
    "tests/benchmarks/test_step_benchmarks.py::test_bench_step_counts_what_each_step_executes",
    "tests/benchmarks/test_step_benchmarks.py::test_bench_dropout_variants_draw_the_same_masks_and_make_the_same_steps",
    "tests/benchmarks/test_step_benchmarks.py::test_modernbert_vs_bert_compares_equal_widths_and_feed_forward_parameters",
    "tests/benchmarks/test_trace_summary.py::test_bench_step_profiles_its_step",
    "tests/benchmarks/test_bench_suite.py::test_a_real_bench_step_run_and_its_table_row",
)


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="also run the tests marked slow (the long rehearsals; tests/helpers/slow_tier.py)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a long end-to-end rehearsal, run only with --slow "
                                       "(tests/helpers/slow_tier.py)")


def runs_slow_tier(config) -> bool:
    return bool(config.getoption("--slow") or os.environ.get("BERT_JAX_SLOW"))


def is_listed(nodeid: str) -> bool:
    return nodeid.split("[")[0] in _LISTED


_LISTED = frozenset(SLOW)


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if is_listed(item.nodeid):
            item.add_marker(pytest.mark.slow)
    if runs_slow_tier(config):
        return
    skip = pytest.mark.skip(reason=REASON)
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)
