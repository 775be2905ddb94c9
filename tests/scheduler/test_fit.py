"""The fit planner on plain data: budgets, residents, variants and configuration patches."""

import pytest

from scheduler.estimation.engines import LlamaCppConfig, VllmConfig, estimate_llamacpp, estimate_vllm
from scheduler.estimation.gguf_header import read_shape
from scheduler.policy.fit import (
    Budget, Candidate, Resident, check_fit, llamacpp_candidates, plan_fit, safety_margin, vllm_candidates,
)

GIB = 2**30


def test_free_for_new_subtracts_reservations_margin_and_memory_used_outside_berth():
    budget = Budget(total_bytes=128 * GIB, reserved_bytes=40 * GIB, measured_used_bytes=50 * GIB,
                    accounted_bytes=40 * GIB, safety_margin_bytes=8 * GIB)
    assert budget.outside_bytes == 10 * GIB
    assert budget.free_for_new == 70 * GIB
    assert check_fit(budget, 70 * GIB).fits
    fit = check_fit(budget, 71 * GIB)
    assert not fit.fits and fit.shortfall_bytes == GIB


def test_outside_use_not_measured_is_not_taken_for_zero_silently():
    fit = check_fit(Budget(total_bytes=80 * GIB, safety_margin_bytes=4 * GIB), 10 * GIB)
    assert fit.outside_bytes is None and fit.notes


def test_reserved_but_not_yet_started_replicas_do_not_count_twice():
    budget = Budget(total_bytes=100 * GIB, reserved_bytes=30 * GIB, measured_used_bytes=5 * GIB, accounted_bytes=30 * GIB)
    assert budget.outside_bytes == 0 and budget.free_for_new == 70 * GIB


def test_safety_margin_is_fixed_on_unified_memory_and_a_share_of_a_discrete_gpu():
    assert safety_margin(128 * GIB, unified_memory=True, unified_bytes=8 * GIB, gpu_percent=5) == 8 * GIB
    assert safety_margin(80 * GIB, unified_memory=False, unified_bytes=8 * GIB, gpu_percent=5) == 4 * GIB


def test_fitting_proposal_has_no_plans():
    assert plan_fit(Budget(total_bytes=80 * GIB), 10 * GIB, residents=[Resident("a", 5 * GIB, can_sleep=True,
                                                                                 sleep_frees_bytes=GIB)]).plans == ()


def test_plans_come_cheapest_first_each_with_the_fit_it_gives():
    budget = Budget(total_bytes=80 * GIB, reserved_bytes=60 * GIB, measured_used_bytes=60 * GIB,
                    accounted_bytes=60 * GIB, safety_margin_bytes=4 * GIB)  # 16 GiB free
    residents = [Resident("chat-small", 20 * GIB, priority=1, can_sleep=True, sleep_frees_bytes=12 * GIB),
                 Resident("batch-embed", 10 * GIB, priority=0),
                 Resident("vip", 30 * GIB, priority=9)]
    candidates = [Candidate("config", "KV cache as q8_0", 18 * GIB, 1, {"cache_type_k": "q8_0"}),
                  Candidate("config", "context 8,192", 15 * GIB, 3, {"ctx_size": 8192}),
                  Candidate("variant", "variant Q4_K_M", 12 * GIB, 6, variant="/m/q4.gguf")]
    fit = plan_fit(budget, 20 * GIB, candidates=candidates, residents=residents, priority=5)
    assert not fit.fits and fit.shortfall_bytes == 4 * GIB
    labels = [p.label for p in fit.plans]
    assert labels == ["context 8,192", "variant Q4_K_M", "sleep chat-small", "stop batch-embed"]
    assert all(p.headroom_bytes >= 0 for p in fit.plans)
    sleep = fit.plans[2]
    assert sleep.free_after_bytes == 28 * GIB and sleep.actions[0].frees_bytes == 12 * GIB
    assert all("vip" not in p.label for p in fit.plans)  # never stop a higher-priority deployment


def test_sleeping_not_enough_alone_combines_with_stopping():
    budget = Budget(total_bytes=50 * GIB, reserved_bytes=45 * GIB)  # 5 free
    residents = [Resident("a", 20 * GIB, priority=3, can_sleep=True, sleep_frees_bytes=5 * GIB),
                 Resident("b", 20 * GIB, priority=0)]
    fit = plan_fit(budget, 20 * GIB, residents=residents, priority=5)
    combined = [p for p in fit.plans if len(p.actions) == 2]
    assert any([a.kind for a in p.actions] == ["sleep", "stop"] for p in combined)


def test_nothing_makes_it_fit_means_no_plans():
    fit = plan_fit(Budget(total_bytes=10 * GIB), 50 * GIB, residents=[Resident("x", GIB, priority=9)], priority=1)
    assert not fit.fits and fit.plans == ()


def test_llamacpp_patches_are_estimated_and_the_least_drastic_that_fits_comes_first(gguf_model):
    shape = read_shape(gguf_model(layers=16, embedding=512, heads=8, kv_heads=8, context=32768))
    config = LlamaCppConfig(ctx_size=32768)
    estimate = estimate_llamacpp(shape, config)
    kv = estimate.kv_cache_bytes
    budget = Budget(total_bytes=estimate.total_bytes - kv // 3)  # a third of the KV cache too little
    fit = plan_fit(budget, estimate.total_bytes,
                   candidates=llamacpp_candidates(config, lambda c: estimate_llamacpp(shape, c), estimate.context_tokens))
    assert fit.plans[0].config_patch == {"cache_type_k": "q8_0", "cache_type_v": "q8_0"}
    contexts = [p.config_patch.get("ctx_size") for p in fit.plans if set(p.config_patch) == {"ctx_size"}]
    assert contexts[0] == 16384  # halving once is enough; shorter ones cost more
    for plan in fit.plans:
        assert plan.estimate_bytes <= budget.free_for_new


def test_fewer_gpu_layers_is_offered_for_an_offloaded_model(gguf_model):
    shape = read_shape(gguf_model(layers=8, embedding=256, heads=4, kv_heads=4))
    config = LlamaCppConfig(ctx_size=512, n_gpu_layers=-1)
    candidates = llamacpp_candidates(config, lambda c: estimate_llamacpp(shape, c), 512)
    patches = [c.config_patch for c in candidates if "n_gpu_layers" in c.config_patch]
    assert {"n_gpu_layers": 4} in patches


def test_vllm_patches_include_fp8_kv_and_fewer_sequences(tmp_path):
    from tests.scheduler.test_estimation import llama_like, write_hf_model
    from scheduler.estimation.reading import read_model

    config = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 8192}
    shape = read_model(write_hf_model(tmp_path / "m", config, llama_like()))
    vllm = VllmConfig(max_num_seqs=64)
    candidates = vllm_candidates(vllm, lambda c: estimate_vllm(shape, c), 8192)
    labels = [c.label for c in candidates]
    assert "KV cache as fp8" in labels and "max_num_seqs 32" in labels and "max_model_len 4,096" in labels
    base = estimate_vllm(shape, vllm).total_bytes
    assert all(c.estimate_bytes < base for c in candidates)


@pytest.mark.parametrize("priority", [0, 1])
def test_equal_or_higher_priority_is_never_stopped(priority):
    fit = plan_fit(Budget(total_bytes=10 * GIB, reserved_bytes=10 * GIB), GIB,
                   residents=[Resident("peer", 10 * GIB, priority=1)], priority=priority)
    assert fit.plans == ()
