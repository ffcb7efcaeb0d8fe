"""Tiny random-weight models of every mlx-lm model type, saved as a user's model directory is.

``ARCH_CONFIG`` is one config every model type reads the keys it knows from; ``ARCH_EXTRA`` adds, per type, what
its family's config.json has that the shared one lacks (written to look like the real family's: one layer of each
kind for hybrids, the family's rope variant, a wrapper's ``text_config``). ``model_types`` lists every model type
in the installed mlx-lm, so a type added by a new release joins the matrix (tests/test_arch_matrix.py) at once.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.models
from mlx.utils import tree_flatten

from nestedkv.cache import layer_press
from nestedkv.introspect import probe
from nestedkv.layer_kinds import kinds
from pipeline.config import RunConfig
from tiny import EOS, VOCAB, randomize, write_byte_tokenizer

INF = float("inf")
MAX_PARAMS = 10_000_000  # a type whose defaults are a real model's size needs its own ARCH_EXTRA

# One config for every architecture of the matrix (tests/test_architectures.py): each model type reads the
# keys it knows. Sliding windows of 32 rows, so a 200-token document wraps them; one layer of two each kind.
ARCH_CONFIG = dict(
    hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, rms_norm_eps=1e-5, layer_norm_eps=1e-5, norm_eps=1e-5, vocab_size=VOCAB, rope_theta=10000.0,
    max_position_embeddings=4096, tie_word_embeddings=True, sliding_window=32, sliding_window_pattern=2,
    query_pre_attn_scalar=16, num_local_experts=4, num_experts=4, num_experts_per_tok=2, experts_per_token=2,
    moe_intermediate_size=32, hidden_act="silu", n_shared_experts=1, shared_expert_intermediate_size=32,
    linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, full_attention_interval=2, partial_rotary_factor=1.0, decoder_sparse_step=1,
    mlp_only_layers=[], norm_topk_prob=True, attention_bias=False, use_qk_norm=True, block_dim=64,
    block_ff_dim=128, block_multiple_of=16, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
    conv_L_cache=3, conv_bias=False, full_attn_idxs=[1], num_heads=4, num_layers=2, logit_scale=1.0,
    use_sliding_window=True, max_window_layers=1,
)


# Each type's own keys over ARCH_CONFIG (a nested dict merges into the one it names).
ARCH_EXTRA = {
    'afm7': {'hidden_dim': 64, 'num_layers': 2, 'num_kv_reuse_layers': 1, 'num_heads': 4, 'num_kv_heads': 2,
        'hidden_dim_scale_factor': 3.25, 'rope_theta': 50000},
    'afmoe': {'layer_types': ['sliding_attention', 'full_attention'], 'num_dense_layers': 1,
        'num_shared_experts': 1, 'route_norm': True, 'route_scale': 2.826, 'score_func': 'sigmoid', 'n_group': 1,
        'topk_group': 1, 'mup_enabled': True, 'rope_scaling': None},
    'apertus': {'mlp_bias': False, 'post_norm': False, 'qk_norm': True, 'hidden_act': 'xielu',
        'tie_word_embeddings': False, 'rope_theta': 12000000.0, 'max_position_embeddings': 65536,
        'rope_scaling': {'rope_type': 'llama3', 'factor': 8.0, 'high_freq_factor': 4.0, 'low_freq_factor': 1.0,
        'original_max_position_embeddings': 8192}},
    'baichuan_m1': {'sliding_window_layers': [0], 'conv_window': 2, 'num_swa_attention_heads': 4,
        'num_swa_key_value_heads': 4, 'tie_word_embeddings': False},
    'bailing_hybrid': {'layer_group_size': 2, 'group_norm_size': 4, 'first_k_dense_replace': 1,
        'num_shared_experts': 1, 'n_group': 2, 'topk_group': 1, 'routed_scaling_factor': 2.5, 'head_dim': 16,
        'kv_lora_rank': 32, 'q_lora_rank': 32, 'qk_rope_head_dim': 16, 'qk_nope_head_dim': 16, 'v_head_dim': 16,
        'partial_rotary_factor': 0.5, 'rope_interleave': True, 'use_qk_norm': True, 'score_function': 'sigmoid',
        'moe_router_enable_expert_bias': True, 'tie_word_embeddings': False, 'rope_theta': 600000},
    'bailing_moe': {'num_shared_experts': 1, 'first_k_dense_replace': 1, 'use_qk_norm': True,
        'partial_rotary_factor': 0.5, 'score_function': 'sigmoid', 'moe_router_enable_expert_bias': True,
        'routed_scaling_factor': 2.5, 'n_group': 2, 'topk_group': 1, 'tie_word_embeddings': False,
        'rope_theta': 600000},
    'bailing_moe_linear': {'num_shared_experts': 1, 'first_k_dense_replace': 1, 'layer_group_size': 2,
        'group_norm_size': 4, 'use_qk_norm': True, 'partial_rotary_factor': 0.5, 'score_function': 'sigmoid',
        'moe_router_enable_expert_bias': True, 'routed_scaling_factor': 2.5, 'n_group': 2, 'topk_group': 1,
        'head_dim': 16, 'tie_word_embeddings': False, 'rope_theta': 600000},
    'bailing_moe_v3': {'moe_intermediate_size': 32, 'moe_shared_expert_intermediate_size': 32, 'num_experts': 4,
        'num_experts_per_tok': 2, 'n_group': 2, 'topk_group': 1, 'layer_group_size': 2, 'head_dim': 16,
        'q_lora_rank': 32, 'kv_lora_rank': 32, 'qk_nope_head_dim': 16, 'qk_rope_head_dim': 16, 'v_head_dim': 16,
        'max_position_embeddings': 4096},
    'dbrx': {'d_model': 64, 'n_layers': 2, 'n_heads': 4, 'attn_config': {'kv_n_heads': 2, 'clip_qkv': 8,
        'rope_theta': 500000}, 'ffn_config': {'ffn_hidden_size': 32, 'moe_num_experts': 4, 'moe_top_k': 2},
        'tie_word_embeddings': False},
    'deepseek_v2': {'kv_lora_rank': 32, 'q_lora_rank': 32, 'qk_rope_head_dim': 16, 'qk_nope_head_dim': 16,
        'v_head_dim': 16, 'n_routed_experts': 4, 'n_shared_experts': 1, 'num_experts_per_tok': 2,
        'topk_method': 'group_limited_greedy', 'n_group': 2, 'topk_group': 1, 'routed_scaling_factor': 16.0,
        'first_k_dense_replace': 1, 'moe_layer_freq': 1, 'num_key_value_heads': 4,
        'max_position_embeddings': 163840, 'tie_word_embeddings': False, 'rope_scaling': {'type': 'yarn',
        'factor': 40, 'beta_fast': 32, 'beta_slow': 1, 'mscale': 0.707, 'mscale_all_dim': 0.707,
        'original_max_position_embeddings': 4096}},
    'deepseek_v3': {'num_key_value_heads': 4, 'kv_lora_rank': 32, 'q_lora_rank': 48, 'qk_rope_head_dim': 16,
        'qk_nope_head_dim': 16, 'v_head_dim': 16, 'n_routed_experts': 4, 'n_shared_experts': 1,
        'num_experts_per_tok': 2, 'n_group': 2, 'topk_group': 1, 'first_k_dense_replace': 1, 'moe_layer_freq': 1,
        'routed_scaling_factor': 2.5, 'scoring_func': 'sigmoid', 'topk_method': 'noaux_tc',
        'tie_word_embeddings': False, 'max_position_embeddings': 163840, 'rope_scaling': {'type': 'yarn',
        'factor': 40, 'original_max_position_embeddings': 4096, 'beta_fast': 32, 'beta_slow': 1, 'mscale': 1.0,
        'mscale_all_dim': 1.0}},
    'deepseek_v32': {'num_key_value_heads': 4, 'kv_lora_rank': 32, 'q_lora_rank': 48, 'qk_rope_head_dim': 16,
        'qk_nope_head_dim': 16, 'v_head_dim': 16, 'index_head_dim': 32, 'index_n_heads': 4, 'index_topk': 64,
        'n_routed_experts': 4, 'n_shared_experts': 1, 'num_experts_per_tok': 2, 'n_group': 2, 'topk_group': 1,
        'first_k_dense_replace': 1, 'routed_scaling_factor': 2.5, 'tie_word_embeddings': False,
        'max_position_embeddings': 163840, 'rope_scaling': {'type': 'yarn', 'factor': 40,
        'original_max_position_embeddings': 4096, 'beta_fast': 32, 'beta_slow': 1, 'mscale': 1.0,
        'mscale_all_dim': 1.0}},
    'dots1': {'first_k_dense_replace': 1, 'n_routed_experts': 4, 'n_shared_experts': 1,
        'routed_scaling_factor': 2.5, 'scoring_func': 'noaux_tc', 'n_group': 1, 'topk_group': 1,
        'tie_word_embeddings': False},
    'ernie4_5': {'use_bias': False, 'rope_theta': 500000},
    'ernie4_5_moe': {'use_bias': False, 'moe_num_experts': 4, 'moe_k': 2, 'moe_layer_start_index': 1,
        'moe_layer_interval': 1, 'moe_num_shared_experts': 1, 'moe_use_aux_free': True, 'moe_gate_act': 'softmax',
        'moe_capacity': [4, 4, 4], 'rope_theta': 500000},
    'exaone': {'num_layers': 2, 'layer_norm_epsilon': 1e-05, 'rope_theta': 1000000.0, 'tie_word_embeddings': False,
        'rope_scaling': {'rope_type': 'llama3', 'factor': 8.0, 'high_freq_factor': 4.0, 'low_freq_factor': 1.0,
        'original_max_position_embeddings': 8192}},
    'exaone4': {'sliding_window_pattern': 'LG', 'layer_types': ['sliding_attention', 'full_attention'],
        'rope_theta': 1000000.0, 'tie_word_embeddings': False,
        'rope_scaling': {'rope_type': 'llama3', 'factor': 16.0, 'high_freq_factor': 4.0, 'low_freq_factor': 1.0,
        'original_max_position_embeddings': 8192}},
    'exaone_moe': {'layer_types': ['sliding_attention', 'full_attention'], 'is_moe_layer': [False, True],
        'num_shared_experts': 1, 'routed_scaling_factor': 2.5, 'n_group': 1, 'topk_group': 1,
        'rope_theta': 1000000.0, 'tie_word_embeddings': False},
    'falcon_h1': {'mamba_d_ssm': 64, 'mamba_n_heads': 4, 'mamba_d_head': 16, 'mamba_d_state': 16,
        'mamba_n_groups': 1, 'mamba_d_conv': 4, 'mamba_expand': 2, 'mamba_chunk_size': 128, 'mamba_rms_norm': False,
        'mamba_norm_before_gate': False, 'rope_theta': 100000000000.0},
    'gear': {'layer_types': None},
    'gemma2': {'sliding_window': 32, 'layer_types': ['sliding_attention', 'full_attention'],
        'cache_implementation': 'hybrid', 'attn_logit_softcapping': 50.0, 'final_logit_softcapping': 30.0,
        'query_pre_attn_scalar': 16, 'hidden_activation': 'gelu_pytorch_tanh'},
    'gemma3': {'text_config': {'model_type': 'gemma3_text', 'hidden_size': 64, 'num_hidden_layers': 2,
        'intermediate_size': 128, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 16,
        'query_pre_attn_scalar': 16, 'rms_norm_eps': 1e-06, 'sliding_window': 32, 'sliding_window_pattern': 2,
        'rope_theta': 1000000.0, 'rope_local_base_freq': 10000.0, 'rope_scaling': {'rope_type': 'linear',
        'factor': 8.0}}, 'vision_config': {'model_type': 'siglip_vision_model', 'hidden_size': 32,
        'num_hidden_layers': 1, 'num_attention_heads': 2, 'intermediate_size': 64, 'patch_size': 14,
        'image_size': 28}},
    'gemma3n': {'text_config': {'model_type': 'gemma3n_text', 'hidden_size': 64, 'num_hidden_layers': 4,
        'intermediate_size': 128, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 16,
        'rms_norm_eps': 1e-06, 'vocab_size': 256, 'vocab_size_per_layer_input': 256,
        'hidden_size_per_layer_input': 16, 'num_kv_shared_layers': 2, 'sliding_window': 32,
        'max_position_embeddings': 32768, 'rope_local_base_freq': 10000.0, 'rope_theta': 1000000.0,
        'final_logit_softcapping': 30.0, 'layer_types': ['sliding_attention', 'full_attention', 'sliding_attention',
        'full_attention'], 'activation_sparsity_pattern': [0.95, 0.0, 0.0, 0.0], 'altup_num_inputs': 4,
        'altup_coef_clip': 120.0, 'altup_correct_scale': True, 'altup_active_idx': 0, 'laurel_rank': 8,
        'hidden_activation': 'gelu_pytorch_tanh'}},
    'gemma4': {'text_config': {'model_type': 'gemma4_text', 'hidden_size': 64, 'num_hidden_layers': 4,
        'intermediate_size': 128, 'num_attention_heads': 4, 'num_key_value_heads': 1, 'head_dim': 16,
        'global_head_dim': 32, 'rms_norm_eps': 1e-06, 'vocab_size_per_layer_input': 256,
        'hidden_size_per_layer_input': 16, 'num_kv_shared_layers': 2, 'sliding_window': 32,
        'max_position_embeddings': 131072, 'layer_types': ['sliding_attention', 'full_attention',
        'sliding_attention', 'full_attention'],
        'rope_parameters': {'full_attention': {'partial_rotary_factor': 0.25, 'rope_theta': 1000000.0,
        'rope_type': 'proportional'}, 'sliding_attention': {'rope_theta': 10000.0, 'rope_type': 'default'}},
        'final_logit_softcapping': 30.0, 'use_double_wide_mlp': True, 'attention_k_eq_v': False,
        'enable_moe_block': False, 'tie_word_embeddings': True, 'hidden_activation': 'gelu_pytorch_tanh'},
        'tie_word_embeddings': True},
    'gemma4_text': {'num_hidden_layers': 4, 'head_dim': 16, 'global_head_dim': 32, 'num_key_value_heads': 1,
        'layer_types': ['sliding_attention', 'full_attention', 'sliding_attention', 'full_attention'],
        'num_kv_shared_layers': 2, 'hidden_size_per_layer_input': 16, 'vocab_size_per_layer_input': 256,
        'use_double_wide_mlp': True, 'final_logit_softcapping': 30.0, 'rms_norm_eps': 1e-06,
        'rope_parameters': {'full_attention': {'partial_rotary_factor': 0.25, 'rope_theta': 1000000.0,
        'rope_type': 'proportional'}, 'sliding_attention': {'rope_theta': 10000.0, 'rope_type': 'default'}}},
    'glm4_moe': {'n_group': 1, 'topk_group': 1, 'n_routed_experts': 4, 'n_shared_experts': 1,
        'routed_scaling_factor': 2.5, 'first_k_dense_replace': 1, 'rope_scaling': None, 'attention_bias': True,
        'partial_rotary_factor': 0.5, 'use_qk_norm': True, 'tie_word_embeddings': False,
        'num_nextn_predict_layers': 1, 'rope_theta': 1000000},
    'glm4_moe_lite': {'num_key_value_heads': 4, 'kv_lora_rank': 32, 'q_lora_rank': 48, 'qk_rope_head_dim': 8,
        'qk_nope_head_dim': 24, 'v_head_dim': 32, 'n_routed_experts': 4, 'n_shared_experts': 1,
        'num_experts_per_tok': 2, 'first_k_dense_replace': 1, 'routed_scaling_factor': 1.8, 'rope_theta': 1000000.0,
        'rope_scaling': None, 'partial_rotary_factor': 1.0, 'max_position_embeddings': 202752,
        'tie_word_embeddings': False},
    'glm_moe_dsa': {'index_head_dim': 32, 'index_n_heads': 4, 'index_topk': 64, 'n_routed_experts': 4,
        'n_shared_experts': 1, 'routed_scaling_factor': 2.5, 'kv_lora_rank': 32, 'q_lora_rank': 32,
        'qk_rope_head_dim': 16, 'qk_nope_head_dim': 16, 'v_head_dim': 16, 'topk_method': 'noaux_tc',
        'scoring_func': 'sigmoid', 'n_group': 1, 'topk_group': 1, 'moe_layer_freq': 1, 'first_k_dense_replace': 1,
        'num_key_value_heads': 4, 'tie_word_embeddings': False, 'rope_parameters': {'rope_theta': 1000000.0,
        'rope_type': 'default'}, 'indexer_rope_interleave': True},
    'gpt2': {'n_ctx': 2048, 'n_positions': 2048, 'n_embd': 64, 'n_head': 4, 'n_layer': 2, 'layer_norm_epsilon': 1e-05,
        'activation_function': 'gelu_new', 'num_key_value_heads': None},
    'gpt_bigcode': {'n_embd': 64, 'n_inner': 128, 'n_head': 4, 'n_layer': 2, 'n_positions': 2048,
        'layer_norm_epsilon': 1e-05, 'multi_query': True, 'num_key_value_heads': None},
    'gpt_neox': {'rotary_emb_base': 10000, 'rotary_pct': 0.25, 'use_parallel_residual': True,
        'num_key_value_heads': None, 'tie_word_embeddings': False},
    'gptj': {'n_embd': 64, 'n_head': 4, 'n_layer': 2, 'rotary_dim': 8, 'n_positions': 2048},
    'granite': {'logits_scaling': 8.0, 'attention_multiplier': 0.0625, 'embedding_multiplier': 12.0,
        'residual_multiplier': 0.22, 'mlp_bias': False},
    'granitemoe': {'logits_scaling': 6.0, 'attention_multiplier': 0.0625, 'embedding_multiplier': 12.0,
        'residual_multiplier': 0.22, 'intermediate_size': 32},
    'granitemoehybrid': {'layer_types': ['mamba', 'attention'], 'position_embedding_type': 'nope',
        'logits_scaling': 6.0, 'attention_multiplier': 0.0625, 'embedding_multiplier': 12.0,
        'residual_multiplier': 0.22, 'intermediate_size': 32, 'shared_intermediate_size': 64, 'mamba_n_heads': 8,
        'mamba_d_head': 16, 'mamba_d_state': 16, 'mamba_d_conv': 4, 'mamba_n_groups': 1, 'mamba_expand': 2,
        'mamba_chunk_size': 256, 'mamba_proj_bias': False, 'mamba_conv_bias': True},
    'helium': {'mlp_bias': False, 'rope_theta': 100000.0, 'tie_word_embeddings': False},
    'hunyuan': {'moe_topk': 2, 'num_shared_expert': 1, 'use_mixed_mlp_moe': True, 'use_cla': True,
        'cla_share_factor': 2, 'moe_intermediate_size': 32, 'rope_scaling': {'alpha': 1000.0, 'beta_fast': 32,
        'beta_slow': 1, 'factor': 1.0, 'mscale': 1.0, 'mscale_all_dim': 1.0, 'type': 'dynamic'}},
    'jamba': {'attn_layer_offset': 1, 'attn_layer_period': 2, 'expert_layer_offset': 1, 'expert_layer_period': 2,
        'mamba_d_conv': 4, 'mamba_d_state': 16, 'mamba_expand': 2, 'mamba_dt_rank': 'auto',
        'mamba_proj_bias': False, 'mamba_conv_bias': True, 'tie_word_embeddings': False},
    'kimi_k25': {'text_config': {'model_type': 'deepseek_v3', 'vocab_size': 256, 'hidden_size': 64,
        'intermediate_size': 128, 'moe_intermediate_size': 32, 'num_hidden_layers': 2, 'num_attention_heads': 4,
        'num_key_value_heads': 4, 'n_shared_experts': 1, 'n_routed_experts': 4, 'routed_scaling_factor': 2.827,
        'kv_lora_rank': 32, 'q_lora_rank': 32, 'qk_rope_head_dim': 16, 'v_head_dim': 16, 'qk_nope_head_dim': 16,
        'topk_method': 'noaux_tc', 'scoring_func': 'sigmoid', 'norm_topk_prob': True, 'n_group': 1, 'topk_group': 1,
        'num_experts_per_tok': 2, 'moe_layer_freq': 1, 'first_k_dense_replace': 1, 'max_position_embeddings': 4096,
        'rms_norm_eps': 1e-05, 'rope_theta': 50000.0, 'rope_scaling': {'type': 'yarn', 'factor': 64.0,
        'original_max_position_embeddings': 64, 'beta_fast': 1.0, 'beta_slow': 1.0, 'mscale': 1.0,
        'mscale_all_dim': 1.0}, 'attention_bias': False, 'tie_word_embeddings': False},
        'vision_config': {'patch_size': 14, 'vt_hidden_size': 64, 'text_hidden_size': 64}},
    'kimi_k3': {'tie_word_embeddings': False, 'text_config': {'model_type': 'kimi_linear', 'vocab_size': 256,
        'hidden_size': 64, 'num_hidden_layers': 2, 'num_attention_heads': 4, 'num_key_value_heads': 4,
        'intermediate_size': 128, 'rms_norm_eps': 1e-05, 'max_position_embeddings': 4096, 'hidden_act': 'situ',
        'activation_situ_beta': 4.0, 'activation_situ_linear_beta': 25.0, 'attn_res_block_size': 1,
        'linear_attn_config': {'kda_layers': [1], 'full_attn_layers': [2], 'num_heads': 4, 'head_dim': 16,
        'short_conv_kernel_size': 4, 'gate_lower_bound': -5.0, 'use_full_rank_gate': True}, 'q_lora_rank': 32,
        'kv_lora_rank': 32, 'qk_nope_head_dim': 16, 'qk_rope_head_dim': 16, 'v_head_dim': 16, 'mla_use_nope': True,
        'mla_use_output_gate': True, 'num_experts': 4, 'num_experts_per_token': 2, 'num_shared_experts': 2,
        'moe_intermediate_size': 32, 'routed_expert_hidden_size': 32, 'latent_moe_use_norm': True,
        'moe_router_activation_func': 'sigmoid', 'moe_renormalize': True, 'routed_scaling_factor': 1.0,
        'first_k_dense_replace': 1, 'moe_layer_freq': 1, 'use_grouped_topk': True, 'num_expert_group': 1,
        'topk_group': 1, 'rope_theta': 10000.0, 'tie_word_embeddings': False}, 'vision_config': {'patch_size': 14,
        'vt_hidden_size': 64, 'text_hidden_size': 64}},
    'kimi_linear': {'linear_attn_config': {'kda_layers': [1], 'full_attn_layers': [2], 'num_heads': 4,
        'head_dim': 16, 'short_conv_kernel_size': 4}, 'model_max_length': 4096, 'kv_lora_rank': 32,
        'q_lora_rank': None, 'qk_nope_head_dim': 16, 'qk_rope_head_dim': 16, 'v_head_dim': 16, 'mla_use_nope': True,
        'num_experts_per_token': 2, 'num_shared_experts': 1, 'moe_router_activation_func': 'sigmoid',
        'moe_renormalize': True, 'routed_scaling_factor': 2.446, 'first_k_dense_replace': 1, 'moe_layer_freq': 1,
        'use_grouped_topk': True, 'num_expert_group': 1, 'topk_group': 1, 'num_key_value_heads': 4,
        'tie_word_embeddings': False},
    'kimi_vl': {'text_config': {'model_type': 'deepseek_v3', 'vocab_size': 256, 'hidden_size': 64,
        'intermediate_size': 128, 'moe_intermediate_size': 32, 'num_hidden_layers': 2, 'num_attention_heads': 4,
        'num_key_value_heads': 4, 'n_shared_experts': 2, 'n_routed_experts': 4, 'routed_scaling_factor': 2.446,
        'kv_lora_rank': 32, 'q_lora_rank': None, 'qk_rope_head_dim': 16, 'v_head_dim': 16, 'qk_nope_head_dim': 16,
        'topk_method': 'noaux_tc', 'scoring_func': 'sigmoid', 'norm_topk_prob': True, 'n_group': 1, 'topk_group': 1,
        'num_experts_per_tok': 2, 'moe_layer_freq': 1, 'first_k_dense_replace': 1, 'max_position_embeddings': 4096,
        'rms_norm_eps': 1e-05, 'rope_theta': 800000.0, 'rope_scaling': None, 'attention_bias': False,
        'tie_word_embeddings': False}, 'vision_config': {'model_type': 'moonvit', 'patch_size': 14,
        'hidden_size': 64, 'num_attention_heads': 4, 'num_hidden_layers': 2, 'intermediate_size': 128,
        'merge_kernel_size': [2, 2]}},
    'lfm2-vl': {'text_config': {'model_type': 'lfm2', 'vocab_size': 256, 'hidden_size': 64, 'num_hidden_layers': 2,
        'num_attention_heads': 4, 'num_key_value_heads': 2, 'max_position_embeddings': 4096, 'norm_eps': 1e-05,
        'conv_bias': False, 'conv_L_cache': 3, 'block_dim': 64, 'block_ff_dim': 128, 'block_multiple_of': 16,
        'block_ffn_dim_multiplier': 1.0, 'block_auto_adjust_ff_dim': True, 'rope_theta': 1000000.0,
        'layer_types': ['conv', 'full_attention'], 'full_attn_idxs': [1]},
        'vision_config': {'model_type': 'siglip2_vision_model', 'hidden_size': 64, 'num_attention_heads': 4,
        'num_hidden_layers': 2, 'intermediate_size': 128, 'patch_size': 16, 'num_patches': 256},
        'downsample_factor': 2, 'projector_hidden_size': 64},
    'lfm2_moe': {'use_expert_bias': True, 'num_dense_layers': 1, 'rope_theta': 1000000.0, 'layer_types': ['conv',
        'full_attention'], 'full_attn_idxs': [1]},
    'lille-130m': {'block_size': 256, 'n_embd': 64, 'n_head': 4, 'n_kv_heads': 2, 'n_layer': 2},
    'llama4': {'text_config': {'model_type': 'llama4_text', 'vocab_size': 256, 'hidden_size': 64,
        'num_hidden_layers': 4, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 16,
        'intermediate_size': 32, 'intermediate_size_mlp': 128, 'num_local_experts': 4, 'num_experts_per_tok': 1,
        'interleave_moe_layer_step': 1, 'attention_chunk_size': 32, 'attention_bias': False,
        'max_position_embeddings': 4096, 'rms_norm_eps': 1e-05, 'rope_theta': 500000.0, 'use_qk_norm': True,
        'no_rope_layers': [1, 1, 1, 0], 'attn_temperature_tuning': True, 'floor_scale': 8192, 'attn_scale': 0.1,
        'rope_scaling': {'factor': 8.0, 'high_freq_factor': 4.0, 'low_freq_factor': 1.0,
        'original_max_position_embeddings': 8192, 'rope_type': 'llama3'}},
        'vision_config': {'model_type': 'llama4_vision_model', 'hidden_size': 64, 'num_attention_heads': 4,
        'num_hidden_layers': 2, 'intermediate_size': 128, 'patch_size': 14, 'image_size': 56,
        'vision_output_dim': 64, 'projector_input_dim': 64, 'projector_output_dim': 64}},
    'llama4_text': {'intermediate_size_mlp': 128, 'no_rope_layers': [1, 0], 'rope_theta': 500000.0,
        'use_qk_norm': True},
    'longcat_flash': {'attention_method': 'MLA', 'zero_expert_type': 'identity', 'ffn_hidden_size': 128,
        'moe_topk': 2, 'expert_ffn_hidden_size': 32, 'n_routed_experts': 4, 'zero_expert_num': 2, 'num_layers': 2,
        'kv_lora_rank': 32, 'q_lora_rank': 32, 'qk_rope_head_dim': 16, 'qk_nope_head_dim': 16, 'v_head_dim': 16,
        'routed_scaling_factor': 6.0, 'rope_theta': 10000000.0, 'mla_scale_q_lora': True, 'mla_scale_kv_lora': True,
        'attention_bias': False, 'norm_topk_prob': False, 'router_bias': False, 'tie_word_embeddings': False},
    'longcat_flash_ngram': {'attention_method': 'MLA', 'zero_expert_type': 'identity', 'ffn_hidden_size': 128,
        'moe_topk': 2, 'expert_ffn_hidden_size': 32, 'n_routed_experts': 4, 'zero_expert_num': 2, 'num_layers': 2,
        'kv_lora_rank': 32, 'q_lora_rank': 32, 'qk_rope_head_dim': 16, 'qk_nope_head_dim': 16, 'v_head_dim': 16,
        'routed_scaling_factor': 6.0, 'rope_theta': 10000000.0, 'mla_scale_q_lora': True, 'mla_scale_kv_lora': True,
        'attention_bias': False, 'norm_topk_prob': False, 'router_bias': False, 'ngram_vocab_size_ratio': 78,
        'emb_neighbor_num': 4, 'emb_split_num': 4, 'tie_word_embeddings': False},
    'mamba': {'intermediate_size': 128, 'state_size': 16, 'conv_kernel': 4, 'use_bias': False,
        'use_conv_bias': True, 'time_step_rank': 'auto', 'layer_norm_epsilon': 1e-05},
    'mamba2': {'num_heads': 8, 'head_dim': 16, 'intermediate_size': 128, 'state_size': 16, 'n_groups': 2,
        'conv_kernel': 4, 'use_bias': False, 'use_conv_bias': True, 'time_step_rank': 'auto',
        'time_step_limit': [0.0, INF], 'layer_norm_epsilon': 1e-05, 'tie_word_embeddings': False},
    'mellum': {'layer_types': ['sliding_attention', 'full_attention'],
        'rope_parameters': {'full_attention': {'rope_type': 'default', 'rope_theta': 500000.0},
        'sliding_attention': {'rope_type': 'default', 'rope_theta': 10000.0}}, 'tie_word_embeddings': False},
    'mimo_v2_flash': {'hybrid_layer_pattern': [0, 1], 'moe_layer_freq': [0, 1], 'add_swa_attention_sink_bias': True,
        'add_full_attention_sink_bias': False, 'sliding_window_size': 32, 'n_routed_experts': 4,
        'n_shared_experts': None, 'routed_scaling_factor': None, 'topk_method': 'noaux_tc',
        'scoring_func': 'sigmoid', 'n_group': 1, 'topk_group': 1, 'layernorm_epsilon': 1e-05,
        'rope_theta': 5000000.0, 'swa_rope_theta': 10000.0, 'num_attention_heads': 4, 'num_key_value_heads': 2,
        'swa_num_attention_heads': 4, 'swa_num_key_value_heads': 2, 'head_dim': 32, 'v_head_dim': 16,
        'swa_head_dim': 32, 'swa_v_head_dim': 16, 'partial_rotary_factor': 0.334, 'attention_value_scale': 0.707,
        'tie_word_embeddings': False},
    'minicpm': {'dim_model_base': 256, 'scale_depth': 1.4, 'scale_emb': 12, 'tie_word_embeddings': False},
    'minicpm3': {'dim_model_base': 256, 'scale_depth': 1.4, 'scale_emb': 12, 'q_lora_rank': 32, 'kv_lora_rank': 16,
        'qk_nope_head_dim': 16, 'qk_rope_head_dim': 16, 'rope_scaling': {'type': 'longrope', 'long_factor': [1.0,
        1.02, 1.07, 1.16, 1.32, 1.6, 2.1, 3.0], 'short_factor': [1.0, 1.02, 1.07, 1.16, 1.32, 1.6, 2.1, 3.0],
        'original_max_position_embeddings': 4096}, 'tie_word_embeddings': False},
    'minimax': {'intermediate_size': 32, 'shared_intermediate_size': 0, 'rotary_dim': 8, 'scoring_func': 'sigmoid',
        'use_qk_norm': True, 'tie_word_embeddings': False},
    'minimax_m3_vl': {'text_config': {'model_type': 'minimax_m3_vl_text', 'vocab_size': 256, 'hidden_size': 64,
        'num_hidden_layers': 2, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 16, 'rotary_dim': 8,
        'intermediate_size': 32, 'shared_intermediate_size': 32, 'dense_intermediate_size': 128,
        'num_local_experts': 4, 'num_experts_per_tok': 2, 'routed_scaling_factor': 2.0,
        'max_position_embeddings': 4096, 'rms_norm_eps': 1e-06, 'rope_theta': 5000000.0, 'use_qk_norm': True,
        'use_gemma_norm': True, 'swiglu_alpha': 1.702, 'swiglu_limit': 7.0, 'tie_word_embeddings': False,
        'moe_layer_freq': [0, 1], 'sparse_attention_config': {'sparse_num_index_heads': 2, 'sparse_index_dim': 16,
        'sparse_block_size': 16, 'sparse_topk_blocks': 4, 'sparse_local_block': 1, 'sparse_attention_freq': [0,
        1]}}},
    'ministral3': {'sliding_window': None, 'rope_parameters': {'rope_type': 'yarn', 'rope_theta': 1000000.0,
        'factor': 32.0, 'original_max_position_embeddings': 128, 'beta_fast': 32.0, 'beta_slow': 1.0, 'mscale': 1.0,
        'mscale_all_dim': 1.0, 'llama_4_scaling_beta': 0.1}},
    'mistral3': {'text_config': {'model_type': 'ministral3', 'vocab_size': 256, 'hidden_size': 64,
        'num_hidden_layers': 2, 'intermediate_size': 128, 'num_attention_heads': 4, 'num_key_value_heads': 2,
        'head_dim': 16, 'rms_norm_eps': 1e-05, 'max_position_embeddings': 4096, 'sliding_window': None,
        'tie_word_embeddings': True, 'rope_parameters': {'rope_type': 'yarn', 'rope_theta': 1000000.0,
        'factor': 32.0, 'original_max_position_embeddings': 128, 'beta_fast': 32.0, 'beta_slow': 1.0, 'mscale': 1.0,
        'mscale_all_dim': 1.0, 'llama_4_scaling_beta': 0.1}}},
    'mistral4': {'num_key_value_heads': 4, 'n_routed_experts': 4, 'n_shared_experts': 1,
        'routed_scaling_factor': 1.0, 'q_lora_rank': 32, 'kv_lora_rank': 16, 'qk_nope_head_dim': 16,
        'qk_rope_head_dim': 16, 'v_head_dim': 32, 'n_group': 1, 'topk_group': 1, 'first_k_dense_replace': 0,
        'rope_interleave': True, 'tie_word_embeddings': False, 'rope_parameters': {'rope_type': 'yarn',
        'rope_theta': 10000.0, 'factor': 32.0, 'original_max_position_embeddings': 128, 'beta_fast': 32.0,
        'beta_slow': 1.0, 'mscale': 1.0, 'mscale_all_dim': 1.0, 'llama_4_scaling_beta': 0.1,
        'partial_rotary_factor': 0.5}},
    'muse_spark': {'text_config': {'hidden_size': 64, 'num_attention_heads': 4, 'num_key_value_heads': 2,
        'head_dim': 16, 'num_hidden_layers': 2, 'vocab_size': 256, 'rms_norm_eps': 1e-05, 'post_norm_eps': 1e-05,
        'rope_parameters': {'rope_theta': 10000.0, 'rope_type': 'default'}, 'layer_rope_theta': [10000.0, 0],
        'layer_types': ['sliding_attention', 'full_attention'], 'sliding_window': 32, 'final_logit_softcapping': 30.0,
        'output_multiplier': 1.0, 'num_local_experts': 4, 'num_experts_per_tok': 2, 'moe_hidden_size': 32,
        'moe_intermediate_size': 32, 'mlp_layer_types': ['sparse', 'sparse']}, 'audio_config': {'out_hidden_size': 64}},
    'nemotron-nas': {'rope_theta': 500000.0, 'rope_scaling': {'factor': 8.0, 'high_freq_factor': 4.0,
        'low_freq_factor': 1.0, 'original_max_position_embeddings': 8192, 'rope_type': 'llama3'},
        'tie_word_embeddings': False, 'block_configs': [{'attention': {'n_heads_in_group': 2, 'no_op': False,
        'replace_with_linear': False, 'sparsify': None, 'num_sink_tokens': None, 'window_length': None,
        'unshifted_sink': False, 'use_prefill_window_in_sink_attention': False}, 'ffn': {'ffn_mult': 2.625,
        'no_op': False, 'replace_with_linear': False, 'sparsify': None}}, {'attention': {'n_heads_in_group': None,
        'no_op': True, 'replace_with_linear': False, 'sparsify': None, 'num_sink_tokens': None,
        'window_length': None, 'unshifted_sink': False, 'use_prefill_window_in_sink_attention': False},
        'ffn': {'ffn_mult': 1.3125, 'no_op': False, 'replace_with_linear': False, 'sparsify': None}}]},
    'nemotron_h': {'hybrid_override_pattern': 'ME*E', 'mamba_num_heads': 8, 'mamba_head_dim': 16,
        'mamba_proj_bias': False, 'ssm_state_size': 16, 'conv_kernel': 4, 'n_groups': 2, 'mlp_bias': False,
        'layer_norm_epsilon': 1e-05, 'use_bias': False, 'use_conv_bias': True, 'time_step_limit': [0.0, INF],
        'time_step_min': 0.001, 'time_step_max': 0.1, 'intermediate_size': 32, 'moe_intermediate_size': 32,
        'moe_shared_expert_intermediate_size': 64, 'n_routed_experts': 4, 'n_shared_experts': 1,
        'num_experts_per_tok': 2, 'n_group': 1, 'topk_group': 1, 'norm_topk_prob': True,
        'routed_scaling_factor': 2.5, 'tie_word_embeddings': False},
    'olmo3': {'layer_types': ['sliding_attention', 'full_attention']},
    'olmo_hybrid': {'linear_allow_neg_eigval': True, 'layer_types': ['linear_attention', 'full_attention'],
        'tie_word_embeddings': False, 'rope_parameters': {'rope_theta': 500000.0, 'rope_type': 'default'}},
    'openelm': {'num_transformer_layers': 2, 'model_dim': 64, 'head_dim': 16, 'num_query_heads': [4, 4],
        'num_kv_heads': [1, 2], 'ffn_multipliers': [0.5, 1.0], 'ffn_dim_divisor': 16, 'ffn_with_glu': True,
        'normalize_qk_projections': True, 'share_input_output_layers': True, 'rope_freq_constant': 10000},
    'phi3': {'rope_scaling': {'type': 'longrope', 'short_factor': [1.0, 1.02, 1.03, 1.03, 1.05, 1.05, 1.05, 1.07],
        'long_factor': [1.08, 1.11, 1.14, 1.34, 1.59, 1.6, 1.62, 2.62]}, 'original_max_position_embeddings': 4096,
        'max_position_embeddings': 131072, 'sliding_window': 262144},
    'phi3small': {'vocab_size': 100352, 'dense_attention_every_n_layers': 2, 'ff_intermediate_size': 128,
        'gegelu_limit': 20.0, 'layer_norm_epsilon': 1e-05, 'blocksparse_block_size': 32,
        'blocksparse_num_local_blocks': 2, 'blocksparse_vert_stride': 2, 'mup_attn_multiplier': 1.0,
        'mup_embedding_multiplier': 10.0, 'mup_use_scaling': True, 'mup_width_multiplier': 8.0,
        'rope_embedding_base': 1000000, 'rope_position_scale': 1.0},
    'phixtral': {'num_vocab': 256, 'model_dim': 64, 'num_heads': 4, 'num_layers': 2, 'rotary_dim': 8},
    'pixtral': {'text_config': {'model_type': 'mistral', 'hidden_size': 64, 'num_hidden_layers': 2,
        'intermediate_size': 128, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 16,
        'rms_norm_eps': 1e-05, 'vocab_size': 256, 'rope_theta': 1000000000.0, 'max_position_embeddings': 1024000,
        'sliding_window': None, 'hidden_act': 'silu'}},
    'plamo': {'n_shared_head': 2},
    'plamo2': {'hidden_size_per_head': 16, 'mamba_d_state': 16, 'mamba_num_heads': 4, 'mamba_step': 2},
    'qwen': {'kv_channels': 16},
    'qwen3_5': {'text_config': {'model_type': 'qwen3_5_text', 'hidden_size': 64, 'num_hidden_layers': 2,
        'intermediate_size': 128, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 32,
        'rms_norm_eps': 1e-06, 'vocab_size': 256, 'max_position_embeddings': 262144, 'linear_num_value_heads': 4,
        'linear_num_key_heads': 2, 'linear_key_head_dim': 16, 'linear_value_head_dim': 16,
        'linear_conv_kernel_dim': 4, 'full_attention_interval': 2, 'layer_types': ['linear_attention',
        'full_attention'], 'attn_output_gate': True, 'tie_word_embeddings': True,
        'rope_parameters': {'rope_type': 'default', 'rope_theta': 10000000.0, 'partial_rotary_factor': 0.25,
        'mrope_interleaved': True, 'mrope_section': [2, 1, 1]}}, 'tie_word_embeddings': True},
    'qwen3_next': {'head_dim': 32, 'partial_rotary_factor': 0.25, 'rope_theta': 10000000.0,
        'linear_num_value_heads': 4, 'linear_num_key_heads': 2, 'layer_types': ['linear_attention',
        'full_attention'], 'norm_topk_prob': True, 'tie_word_embeddings': False, 'max_position_embeddings': 262144},
    'qwen3_vl_moe': {'text_config': {'model_type': 'qwen3_vl_moe_text', 'hidden_size': 64, 'num_hidden_layers': 2,
        'intermediate_size': 128, 'num_attention_heads': 4, 'num_key_value_heads': 2, 'head_dim': 16,
        'rms_norm_eps': 1e-06, 'vocab_size': 256, 'rope_theta': 5000000.0, 'max_position_embeddings': 262144,
        'num_experts': 4, 'num_experts_per_tok': 2, 'moe_intermediate_size': 32, 'decoder_sparse_step': 1,
        'mlp_only_layers': [], 'norm_topk_prob': True, 'tie_word_embeddings': False,
        'rope_scaling': {'mrope_interleaved': True, 'mrope_section': [3, 3, 2], 'rope_type': 'default'}},
        'tie_word_embeddings': False},
    'recurrent_gemma': {'attention_bias': False, 'conv1d_width': 4, 'logits_soft_cap': 30.0,
        'attention_window_size': 32, 'num_key_value_heads': 1, 'block_types': ['recurrent', 'attention'],
        'embeddings_scale_by_sqrt_dim': True, 'rms_norm_eps': 1e-06},
    'rwkv7': {'head_dim': 16, 'a_low_rank_dim': 16, 'v_low_rank_dim': 16, 'gate_low_rank_dim': 16,
        'decay_low_rank_dim': 16, 'norm_eps': 1e-05, 'tie_word_embeddings': False},
    'smollm3': {'no_rope_layers': [1, 0], 'no_rope_layer_interval': 2, 'use_sliding_window': False,
        'sliding_window': None},
    'solar_open': {'n_routed_experts': 4, 'n_shared_experts': 1, 'num_experts_per_tok': 2,
        'routed_scaling_factor': 1.0, 'first_k_dense_replace': 0, 'norm_topk_prob': True,
        'tie_word_embeddings': False, 'use_qk_norm': False, 'n_group': 1, 'topk_group': 1, 'rope_theta': 1000000,
        'max_position_embeddings': 4096, 'rope_scaling': {'type': 'yarn', 'factor': 2.0,
        'original_max_position_embeddings': 2048}},
    'spark2_5': {'layer_types': ['sliding_attention', 'full_attention'],
        'rope_parameters': {'full_attention': {'rope_type': 'default', 'rope_theta': 5000000.0,
        'partial_rotary_factor': 0.25}, 'sliding_attention': {'rope_type': 'default', 'rope_theta': 10000.0}},
        'hidden_act': 'gelu', 'gate_attn_act_mode': 'sigmoid', 'headwise_attn_output_gate': True},
    'stablelm': {'use_qkv_bias': True, 'partial_rotary_factor': 0.25, 'qk_layernorm': False,
        'use_parallel_residual': False, 'tie_word_embeddings': False},
    'step3p5': {'num_attention_groups': 2, 'layer_types': ['full_attention', 'sliding_attention'],
        'attention_other_setting': {'attention_type': 'sliding_attention', 'head_dim': 16,
        'num_attention_groups': 2, 'num_attention_heads': 6, 'true_head_dim': 16}, 'rope_theta': [5000000.0,
        10000.0], 'partial_rotary_factors': [0.5, 1.0], 'yarn_only_types': ['full_attention'],
        'rope_scaling': {'rope_type': 'llama3', 'factor': 2.0, 'original_max_position_embeddings': 2048,
        'low_freq_factor': 1.0, 'high_freq_factor': 32.0}, 'use_head_wise_attn_gate': True, 'moe_layers_enum': '1',
        'moe_num_experts': 4, 'moe_top_k': 2, 'moe_intermediate_size': 32, 'share_expert_dim': 32,
        'moe_router_scaling_factor': 3.0, 'norm_expert_weight': True, 'swiglu_limits': [0.0, 7.0],
        'swiglu_limits_shared': [0.0, 16.0], 'tie_word_embeddings': False},
    'youtu_llm': {'num_key_value_heads': 4, 'kv_lora_rank': 32, 'q_lora_rank': 32, 'qk_rope_head_dim': 16,
        'v_head_dim': 16, 'qk_nope_head_dim': 16},
}


# Types no tiny random model here can stand for, and why (they are left out of the matrix, and listed in
# docs/architectures.md as not tested).
NOT_BUILT = {
    "prism_hadamard_qwen35": "its weights are pre-packed 2-bit Hadamard blocks (uint32 packs, fp16 scales, sign "
                             "vectors) that random weights cannot stand for",
}


def model_types() -> list[str]:
    """Every model type of the installed mlx-lm: the modules of ``mlx_lm.models`` defining ``Model`` and
    ``ModelArgs`` (read as text: some modules exit at import without an optional package)."""
    root = Path(mlx_lm.models.__file__).parent
    return sorted(p.stem for p in root.glob("*.py")
                  if re.search(r"^class Model\(", p.read_text(), re.M) and "class ModelArgs" in p.read_text())


def merged(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def arch_config(kind: str, **overrides) -> dict:
    return {**merged(ARCH_CONFIG, ARCH_EXTRA.get(kind, {})), **overrides, "model_type": kind}


def make_arch_model(kind: str, seed: int = 0, **overrides) -> nn.Module:
    """A tiny random model of any mlx-lm model type (``ARCH_CONFIG``, its ``ARCH_EXTRA`` and ``overrides``)."""
    arch = importlib.import_module(f"mlx_lm.models.{kind}")
    model = arch.Model(arch.ModelArgs.from_dict(arch_config(kind, **overrides)))
    size = sum(p.size for _, p in tree_flatten(model.parameters()))  # lazy: nothing is allocated yet
    if size > MAX_PARAMS:
        raise ValueError(f"{kind}: {size:,} parameters from ARCH_CONFIG; give it tiny sizes in ARCH_EXTRA")
    return randomize(model, seed)


def save_arch_dir(kind: str, path, *, bits: int | None = None, dtype=None, seed: int = 0,
                  tokenizer: dict | None = None, **overrides) -> Path:
    """A tiny model of ``kind`` saved as an mlx-lm directory with the byte tokenizer: ``bits`` 4 or 8 quantized
    as mlx-lm's convert does (groups of 32, the config's "quantization"), or its floats in ``dtype``;
    ``tokenizer``: more tokenizer_config.json entries (a chat template)."""
    from mlx.utils import tree_map
    from mlx_lm.utils import quantize_model, save_config, save_model

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {**arch_config(kind, **overrides), "eos_token_id": EOS}
    write_byte_tokenizer(path, **(tokenizer or {}))
    try:
        model = make_arch_model(kind, seed, **overrides)
    except SystemExit:  # mlx-lm's module exits at import without a package it needs: no weights to make
        save_config(config, path / "config.json")
        mx.save_safetensors(str(path / "model.safetensors"), {"placeholder": mx.zeros(1)})
        return path
    if dtype is not None:
        model.update(tree_map(lambda p: p.astype(dtype) if mx.issubdtype(p.dtype, mx.floating) else p,
                                       model.parameters()))
        config["torch_dtype"] = str(dtype).removeprefix("mlx.core.")
    if bits is not None:
        model, config = quantize_model(model, config, group_size=32, bits=bits)
    save_model(path, model)
    save_config(config, path / "config.json")
    return path


# What the pipeline says, in one line before any run opens, for the types it does not run on this machine (a
# regular expression of that line).
REFUSED = {
    "bitnet": "forward pass of 8 tokens failed",  # mlx-lm's BitNet kernels are Metal-only
    "deepseek_v32": "rows must stay aligned",  # DeepSeek sparse attention: an indexer over the attention's keys
    "deepseek_v41": "uses LayerCache",  # a cache that compresses by itself (window and compressed groups)
    "glm_moe_dsa": "rows must stay aligned",
    "mamba": "no full-attention",
    "mamba2": "no full-attention",
    "minimax_m3_vl": "rows must stay aligned",
    "muse_glimmer": "no full-attention",
    "muse_spark": "could not load model",  # mlx-lm 0.32.2 names a chat template module that lacks its function
    "nemotron-nas": "could not load model",  # transformers 5 cannot read its rope_scaling for the tokenizer
    "olmo": "exited while loading",  # mlx-lm's module needs the ai2-olmo package
    "recurrent_gemma": "no full-attention",
    "rwkv7": "no full-attention",
}


def matrix_types() -> list[str]:
    """The types the matrix runs: every model type but those no tiny model stands for."""
    return [t for t in model_types() if t not in NOT_BUILT]


def describe(kind: str) -> dict:
    """One row of docs/architectures.md's table for a type: its caches' kinds and what NestedKV's defaults do
    on each compressed layer (computed on the tiny model, as ``nkv run`` would, without running a batch)."""
    if kind in REFUSED:
        return {"type": kind, "kinds": "", "adapted": "", "status": f"refused in one line: {REFUSED[kind]}"}
    model = make_arch_model(kind)
    facts = probe(model)
    layer_kinds = kinds(model.make_cache()) if hasattr(model, "make_cache") else ["full"]
    press = RunConfig().make_press()  # nkv run's defaults: NestedKV, r = 0.75, adaptive head budgets, unrotated
    notes = sorted({note.split(":")[0] for f in facts for note in (layer_press(press, f)[1] or "").split("; ")
                    if note})
    ropes = sorted({"not undone" if f.rope is None else "no position" if not f.rope["dims"] else "rope"
                    for f in facts})
    return {"type": kind, "kinds": ", ".join(sorted(set(layer_kinds))), "keys": ", ".join(ropes),
            "adapted": "; ".join(notes), "status": "runs"}


def table(kinds_: list[str]) -> str:
    """docs/architectures.md's matrix, one row per model type."""
    rows = ["| model type | cache kinds | keys of compressed layers | adapted on some layer | with `nkv run`'s defaults |",
            "|---|---|---|---|---|"]
    for kind in kinds_:
        d = describe(kind)
        rows.append(f"| {kind} | {d['kinds']} | {d.get('keys', '')} | {d['adapted']} | {d['status']} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # python tests/archs.py: write docs/architectures.md's matrix table
    import nestedkv

    nestedkv.enable_cpu_fast_path()
    doc = Path(__file__).resolve().parents[1] / "docs" / "architectures.md"
    head, rest = doc.read_text().split("<!-- matrix -->\n")
    doc.write_text(head + "<!-- matrix -->\n" + table(matrix_types()) + "<!-- /matrix -->" + rest.split("<!-- /matrix -->")[1])
