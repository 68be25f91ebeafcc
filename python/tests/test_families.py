"""Every causal-LM family of transformers on a tree pack (issue 36 item 3).

For each model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (transformers
5.24.0: 196), the table ``FAMILIES`` below says what treeattn does with it,
and the tests check that it still does:

- ``Exact``: a tiny random model of the family in float64 (2 layers, or one
  layer of each kind its ``layer_types`` has; vocabulary 96 with pad / bos /
  eos inside it; windows of 5 positions, shorter than the calls; attention
  logit softcap 1 and final logit softcap 2; initializer range 0.2, so the
  scores are O(1) and every variant moves the result), used as a user would
  (``treeattn.hf.register()``, ``model.set_attn_implementation("treeattn")``,
  ``treeattn.hf.target_logprobs(model, pack)``) on one trie pack of a
  compaction rollout and a GRPO group of three, gives every target the
  log-prob of its call run alone with the model's own ``eager`` attention,
  to 1e-9. The attention variants the hook computed (sliding window,
  softcap, sinks, a value head dim unlike q / k's) must be exactly the ones
  listed, and for each listed variant a negative control drops it and must
  be off by more than 1e-3 — so the data makes every variant matter.
- ``Refused``: the same use raises a ``ValueError`` whose message names the
  reason (matched by a regex).
- ``Unclear``: the same use raises another error before treeattn's
  attention runs (a known defect, listed so that a change is noticed).
- ``OutOfScope``: not a decoder-only causal LM — an encoder model used as a
  decoder, the decoder of an encoder-decoder, or a multimodal / composite
  wrapper whose text model is swept under its own type. Not run, except
  those that treeattn would run: they must be refused.

The truth is float64 throughout: transformers' eager attention and many
layers compute in float32 (``softmax(..., dtype=torch.float32)``,
``.float()``, ``.to(torch.float32)``, ``.type(torch.float32)``), which
would put ~1e-7 between two correct answers (INTEGRATION-NOTES); the
``float64`` context below keeps float64 tensors in float64, for the truth
and the packed run alike, so the only difference left is the order of the
attention sums (seen: <= 6.2e-14).

A transformers upgrade that adds a family, removes one, or changes what one
does on a tree fails here, naming the family. ``docs/limits.md`` has the
table this file checks. Run time: one pack of 79 tokens, 11 calls of 11 to
26 tokens; ~15 s on two CPU cores (one torch thread).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Dict, Optional, Tuple

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

import treeattn  # noqa: E402
import treeattn.hf  # noqa: E402

TRANSFORMERS = "5.24.0"  # the version the table was measured with
VOCAB = 96
BOUND = 1e-9  # exact: max |Δ log p| over the pack's targets
MATTERS = 1e-3  # a dropped variant must move some target by more than this


# --------------------------------------------------------------------------
# the expected outcomes


@dataclasses.dataclass(frozen=True)
class Exact:
    """Every target equals its call run alone to ``BOUND``. ``variants``:
    what the hook must see and compute — ``"window"`` (sliding_window),
    ``"softcap"`` (attention logit softcap), ``"sinks"`` (s_aux),
    ``"value_dim"`` (value head dim unlike q / k's, MLA) — and
    ``"final_softcap"`` (the output head's softcap). ``head``: a regex when
    the chunked head of ``target_logprobs`` refuses the model (a ValueError
    naming it); the targets are then scored with ``logits=``, as the error
    says."""

    variants: Tuple[str, ...] = ()
    cfg: Optional[dict] = None
    head: Optional[str] = None
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Refused:
    match: str
    reason: str
    cfg: Optional[dict] = None


@dataclasses.dataclass(frozen=True)
class Unclear:
    error: type
    match: str
    reason: str
    cfg: Optional[dict] = None


@dataclasses.dataclass(frozen=True)
class OutOfScope:
    reason: str
    refused: Optional[str] = None  # treeattn would run it: it must refuse (regex)
    cfg: Optional[dict] = None


W, S, K, V, FS = "window", "softcap", "sinks", "value_dim", "final_softcap"

NOT_INTERFACE = r"does not route its attention through transformers' attention interface"
RECURRENT = r"runs a recurrence that treeattn cannot run on a tree pack"
MASK_ONLY = r"only through the mask transformers builds"
PACKED_ORDER = r"embeds the positions 0 … L−1 of the packed order"

ENCODER = "an encoder (bidirectional, masked-LM) model that can be used as a decoder"
ENC_DEC = "the decoder of an encoder-decoder model (cross-attention to an encoder)"
COMPOSITE = "a composite (multimodal) config; its text model is swept as {}"
MULTIMODAL = "a multimodal model"

# Attention that is not transformers' AttentionInterface: set_attn_implementation
# leaves the config on "eager" (with a warning) and target_logprobs refuses it.
OWN_ATTENTION = "its attention does not go through transformers' AttentionInterface"
_RECURRENT = "recurrent / linear-attention layers that treeattn.hybrid does not run on a tree"
_HYBRID = "hybrid: recurrent layers run along the pack's paths by treeattn.hybrid"

FAMILIES: Dict[str, object] = {
    # ---- decoder-only causal LMs: exact
    "afmoe": Exact((W,)),
    "apertus": Exact(),
    "apertus1p5_text": Exact(),
    "arcee": Exact(),
    "aria_text": Exact(),
    "axk1": Exact((V,)),
    "bamba": Exact(cfg=dict(keep_layer_types=True, attn_layer_indices=[1], mamba_n_heads=16, mamba_d_head=8,
                            mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=8), note=_HYBRID),
    "beam": Exact((W, FS)),
    "biogpt": Exact(),
    "bitnet": Exact(),
    "codegen": Exact(),
    "cohere": Exact(),
    "cohere2": Exact((W,)),
    "cohere2_moe": Exact((W,)),
    "cohere_compass_text": Exact((W,), cfg=dict(
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={t: {"rope_type": "default", "rope_theta": 10000.0}
                         for t in ("full_attention", "sliding_attention")})),
    "ctrl": Exact(),
    "cwm": Exact((W,)),
    "dbrx": Exact(cfg=dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=256,
                           attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                           ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2})),
    "deepseek_v2": Exact((V,)),
    "deepseek_v3": Exact((V,)),
    "diffllama": Exact(),
    "dory": Exact((W,), head=r"DoryForCausalLM changes its logits after the output embedding",
                  note="per-token logit scale in its head"),
    "dots1": Exact((W,), cfg=dict(layer_types=["sliding_attention", "full_attention"])),
    "ernie4_5": Exact(),
    "ernie4_5_moe": Exact(),
    "exaone": Exact(),
    "exaone4": Exact((W,)),
    "exaone_moe": Exact((W,)),
    "falcon_h1": Exact(cfg=dict(keep_layer_types=True, mamba_d_ssm=128, mamba_n_heads=16, mamba_d_head=8,
                                mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=8), note=_HYBRID),
    "flex_olmo": Exact(),
    "flint": Exact((W, K)),
    "gemma": Exact(),
    "gemma2": Exact((W, S, FS)),
    "gemma3_text": Exact((W, FS)),
    "gemma3n_text": Exact((W, FS), cfg=dict(
        layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, laurel_rank=8),
        note="the last two layers reuse the first two's keys and values"),
    "gemma4_text": Exact((W, FS), cfg=dict(per_layer_config={}, vocab_size_per_layer_input=VOCAB,
                                        hidden_size_per_layer_input=8)),
    "gemma4_unified_text": Exact((W, FS), cfg=dict(per_layer_config={})),
    "glm": Exact(),
    "glm4": Exact(),
    "glm4_moe": Exact(),
    "glm4_moe_lite": Exact((V,)),
    "gpt-sw3": Exact(),
    "gpt2": Exact(),
    "gpt_bigcode": Exact(),
    "gpt_neox": Exact(),
    "gpt_oss": Exact((W, K)),
    "gptj": Exact(),
    "granite": Exact(),
    "granite_swa": Exact((W, K)),
    "granitemoe": Exact(),
    "granitemoe_swa": Exact((W, K)),
    "granitemoehybrid": Exact(cfg=dict(layer_types=["mamba", "attention"], shared_intermediate_size=32,
                                       mamba_n_heads=16, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=16,
                                       mamba_chunk_size=8), note=_HYBRID),
    "granitemoeshared": Exact(),
    "helium": Exact(),
    "hrm_text": Exact(),
    "hunyuan_v1_dense": Exact(),
    "hunyuan_v1_moe": Exact(),
    "hy_v3": Exact(),
    "hyperclovax": Exact(),
    "internlm3": Exact(),
    "iquestcoder": Exact(),
    "jais2": Exact(),
    "jetmoe": Exact(),
    "kolibri1": Exact((W,)),
    "laguna": Exact(),
    "llama": Exact(),
    "longcat_flash": Exact((V,), cfg=dict(num_layers=1, ffn_hidden_size=64, expert_ffn_hidden_size=32,
                                          zero_expert_num=2)),
    "mamba2": Exact(cfg=dict(keep_layer_types=True, hidden_size=32, num_heads=8, head_dim=8, state_size=16,
                             n_groups=2, expand=2, conv_kernel=4, chunk_size=8), note=_HYBRID + " (no attention)"),
    "mellum": Exact(),
    "mimo_v2_flash": Exact((W, K, V)),
    "minicpm3": Exact((V,), head=r"MiniCPM3ForCausalLM changes its logits after the output embedding",
                      note="the head's logits_scaling divides the hidden states before lm_head"),
    "minimax_m2": Exact(),
    "minimax_m3_vl_text": Exact(),
    "ministral": Exact((W,)),
    "ministral3": Exact((W,)),
    "mistral": Exact((W,)),
    "mixtral": Exact((W,)),
    "modernbert-decoder": Exact((W,)),
    "moshi": Exact(note="MoshiAttention stores sliding_window but its mask is plain causal"),
    "nanochat": Exact((FS,)),
    "nemotron_h": Exact(cfg=dict(layers_block_type=["mamba", "attention"], ssm_state_size=16, mamba_num_heads=16,
                                 mamba_head_dim=8, n_groups=2, expand=2, conv_kernel=4, chunk_size=8),
                        note=_HYBRID),
    "olmo": Exact(),
    "olmo2": Exact(),
    "olmo3": Exact((W,)),
    "olmoe": Exact(),
    "opt": Exact(),
    "persimmon": Exact(),
    "phi": Exact(),
    "phi3": Exact((W,)),
    "qwen2": Exact((W,)),
    "qwen3": Exact((W,)),
    "qwen3_5_moe_text": Exact(cfg=dict(layer_types=["linear_attention", "full_attention"],
                                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                                       linear_value_head_dim=16, linear_conv_kernel_dim=4,
                                       shared_expert_intermediate_size=32), note=_HYBRID),
    "qwen3_5_text": Exact(cfg=dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                                   linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                   linear_conv_kernel_dim=4), note=_HYBRID),
    "qwen3_moe": Exact((W,)),
    "qwen3_next": Exact(cfg=dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                                 linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                                 linear_conv_kernel_dim=4, shared_expert_intermediate_size=32), note=_HYBRID),
    "sarvam_mla": Exact((V,)),
    "sarvam_moe": Exact(),
    "seed_oss": Exact(),
    "smollm3": Exact(),
    "solar_open": Exact(),
    "starcoder2": Exact((W,)),
    "vaultgemma": Exact((W, S, FS)),
    "youtu": Exact((V,)),
    # ---- refused, with the reason in the error
    "bloom": Refused(NOT_INTERFACE, OWN_ATTENTION + " (ALiBi)"),
    "cpmant": Refused(NOT_INTERFACE, OWN_ATTENTION),
    "deepseek_v4": Refused(r"needs as many keys as queries",
                           "compressed key blocks: the layer attends to keys that are not the packed tokens"),
    "doge": Refused(r"the layer made this one itself", "a learned dynamic mask built by the layer"),
    "falcon": Refused(NOT_INTERFACE, OWN_ATTENTION, cfg=dict(new_decoder_architecture=True, num_kv_heads=2)),
    "gpt_neo": Refused(NOT_INTERFACE, OWN_ATTENTION + " (local attention)",
                       cfg=dict(attention_types=[[["global", "local"], 1]], num_layers=2, window_size=5)),
    "gpt_neox_japanese": Refused(NOT_INTERFACE, OWN_ATTENTION),
    "llama4_text": Refused(MASK_ONLY + r".*depth",
                           "chunked attention (attention_chunk_size) applied only through transformers' mask; "
                           "refused when a row is as deep as a chunk",
                           cfg=dict(attention_chunk_size=4)),
    "mpt": Refused(NOT_INTERFACE, OWN_ATTENTION + " (ALiBi)"),
    "nemotron": Refused(r"did not hand the model call's keyword arguments",
                        "its decoder layer does not pass the call's keyword arguments (kv_end) to attention"),
    "openai-gpt": Refused(NOT_INTERFACE, OWN_ATTENTION),
    "phimoe": Refused(MASK_ONLY + r".*depth", "sliding window applied only through transformers' mask "
                      "(no sliding_window keyword); refused when a row is as deep as the window"),
    "qwen2_moe": Refused(MASK_ONLY + r".*depth", "sliding window (use_sliding_window) applied only through "
                         "transformers' mask; refused when a row is as deep as the window"),
    "stablelm": Refused(r"did not hand the model call's keyword arguments",
                        "its decoder layer does not pass the call's keyword arguments (kv_end) to attention"),
    "xglm": Refused(NOT_INTERFACE, OWN_ATTENTION),
    # recurrent / linear-attention families that treeattn.hybrid refuses
    "bailing_hybrid": Refused(RECURRENT, _RECURRENT),
    "falcon_mamba": Refused(RECURRENT, _RECURRENT, cfg=dict(keep_layer_types=True, state_size=8)),
    "inkling_text": Refused(RECURRENT, _RECURRENT),
    "inkling2_text": Refused(RECURRENT, _RECURRENT),
    "inkling2_loop_text": Refused(RECURRENT, _RECURRENT),
    "jamba": Refused(RECURRENT, _RECURRENT, cfg=dict(keep_layer_types=True, attn_layer_period=2, attn_layer_offset=1,
                                                     expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8)),
    "kimi_linear": Refused(RECURRENT, _RECURRENT),
    "lara_mini": Refused(RECURRENT, _RECURRENT),
    "lfm2": Refused(RECURRENT, _RECURRENT),
    "lfm2_moe": Refused(RECURRENT, _RECURRENT, cfg=dict(layer_types=["conv", "full_attention"], num_dense_layers=1)),
    "lfm3": Refused(RECURRENT, _RECURRENT),
    "mamba": Refused(RECURRENT, _RECURRENT, cfg=dict(keep_layer_types=True, state_size=8)),
    "minimax": Refused(RECURRENT, _RECURRENT),
    "olmo_hybrid": Refused(RECURRENT, _RECURRENT),
    "recurrent_gemma": Refused(RECURRENT, _RECURRENT, cfg=dict(keep_layer_types=True)),
    "rwkv": Refused(NOT_INTERFACE, "RWKV time mixing (no attention)"),
    "xlstm": Refused(RECURRENT, _RECURRENT, cfg=dict(keep_layer_types=True)),
    "qwen4_exp_text": Refused(RECURRENT, _RECURRENT, cfg=dict(indexer_n_heads=2, indexer_kv_heads=1,
                                                              indexer_head_dim=16, indexer_budget=8,
                                                              indexer_compress_ratio=4)),
    "zamba": Refused(RECURRENT, _RECURRENT, cfg=dict(keep_layer_types=True, num_hidden_layers=3,
                                                     layers_block_type=["mamba", "hybrid", "hybrid"])),
    "zamba2": Refused(RECURRENT, _RECURRENT, cfg=dict(keep_layer_types=True, layers_block_type=["mamba", "hybrid"])),
    "zaya": Refused(RECURRENT, _RECURRENT, cfg=dict(num_experts_per_tok=1)),
    # ---- crashes before treeattn's attention runs
    **{
        mt: Unclear(TypeError, r"'NoneType' object is not subscriptable",
                    "DeepSeek sparse attention: the lightning indexer reads the dense mask (attention_mask[:, 0]) "
                    "that treeattn's mask function does not build, before treeattn's attention runs")
        for mt in ("axk2", "deepseek_v32", "glm_moe_dsa", "hy_v4")
    },
    "dots3_note_text": Unclear(TypeError, r"'NoneType' object is not subscriptable",
                               "DeepSeek sparse attention (its indexed layers): the lightning indexer reads the dense "
                               "mask that treeattn's mask function does not build, before treeattn's attention runs",
                               cfg=dict(per_layer_config={}, head_dim=16, index_head_dim=16, index_n_heads=2,
                                        shared_experts_intermediate_size=32)),
    # ---- out of scope
    **{mt: OutOfScope(ENCODER) for mt in (
        "bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie", "megatron-bert",
        "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer", "xlm-roberta", "xlm-roberta-xl", "xmod",
    )},
    "xlm": OutOfScope("XLM: a cross-lingual masked / causal LM of the BERT era (own attention)"),
    "reformer": OutOfScope("Reformer: LSH / chunked local self-attention"),
    "xlnet": OutOfScope("XLNet: permutation LM with two-stream attention"),
    **{mt: OutOfScope(ENC_DEC) for mt in ("bigbird_pegasus", "mvp", "prophetnet", "trocr", "musicgen",
                                         "musicgen_melody")},
    **{mt: OutOfScope(ENC_DEC, refused=PACKED_ORDER) for mt in (
        "bart", "blenderbot-small", "marian", "mbart", "pegasus")},
    "blenderbot": OutOfScope(ENC_DEC, refused=PACKED_ORDER, cfg=dict(
        d_model=64, decoder_attention_heads=4, encoder_attention_heads=4, decoder_layers=2, encoder_layers=1,
        decoder_ffn_dim=64, encoder_ffn_dim=64)),
    "plbart": OutOfScope(ENC_DEC, refused=PACKED_ORDER, cfg=dict(
        d_model=64, decoder_attention_heads=4, encoder_attention_heads=4, decoder_layers=2, encoder_layers=1,
        decoder_ffn_dim=64, encoder_ffn_dim=64)),
    "whisper": OutOfScope(ENC_DEC + "; its decoder takes position_ids (exact when tried, not checked here)"),
    "blt": OutOfScope("BLT: byte latent transformer (local encoder / decoder cross-attending to patches)"),
    "emu3": OutOfScope(MULTIMODAL),
    "fuyu": OutOfScope(MULTIMODAL),
    "git": OutOfScope(MULTIMODAL + "; NOT refused and wrong on a tree pack: its text attention (GitSelfAttention) "
                      "is chosen for eager at init, never calls treeattn's hook and ignores kv_end"),
    "got_ocr2": OutOfScope(MULTIMODAL),
    "mllama": OutOfScope(MULTIMODAL + " (text layers cross-attend to images)"),
    "moss_transcribe_diarize": OutOfScope(MULTIMODAL + " (speech)"),
    "phi4_multimodal": OutOfScope(MULTIMODAL),
    "dots3_note": OutOfScope(COMPOSITE.format("dots3_note_text")),
    "gemma3": OutOfScope(COMPOSITE.format("gemma3_text")),
    "gemma3n": OutOfScope(COMPOSITE.format("gemma3n_text")),
    "gemma4": OutOfScope(COMPOSITE.format("gemma4_text")),
    "gemma4_unified": OutOfScope(COMPOSITE.format("gemma4_unified_text")),
    "gemma4_unified_assistant": OutOfScope(COMPOSITE.format("gemma4_unified_text") + " (a drafter)"),
    "gemma4_assistant": OutOfScope("Gemma 4 drafter (assistant) model reading a backbone's states"),
    "llama4": OutOfScope(COMPOSITE.format("llama4_text")),
    "qwen3_5": OutOfScope(COMPOSITE.format("qwen3_5_text")),
    "qwen3_5_moe": OutOfScope(COMPOSITE.format("qwen3_5_moe_text")),
    "qwen4_exp": OutOfScope(COMPOSITE.format("qwen4_exp_text")),
}


# --------------------------------------------------------------------------
# tiny configs

COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
    eos_token_id=2, attention_dropout=0.0, initializer_range=0.2, sliding_window=5, use_sliding_window=True,
    max_window_layers=1, attn_logit_softcapping=1.0, final_logit_softcapping=2.0,
    # MoE: 4 experts, 2 per token, one group
    moe_intermediate_size=32, num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    n_group=1, topk_group=1, n_shared_experts=1,
    # MLA (value head dim 24, q / k 16)
    kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=24,
    rotary_dim=8,
)


def _has(config, name: str) -> bool:
    try:
        return hasattr(config, name)
    except Exception:  # a per-layer attribute read globally (Gemma 4, dots3): it exists
        return True


def tiny_config(mt: str, spec) -> "transformers.PretrainedConfig":
    """The family's config with ``COMMON``'s values for the fields its
    default config has (properties skipped), then the spec's ``cfg``."""
    base = CONFIG_MAPPING[mt]()
    cls = type(base)
    kw = {k: v for k, v in COMMON.items() if _has(base, k) and not isinstance(getattr(cls, k, None), property)}
    extra = dict(getattr(spec, "cfg", None) or {})
    if _has(base, "kv_lora_rank"):  # MLA: one kv head per query head; head_dim is the rotary part
        kw["num_key_value_heads"] = kw.get("num_attention_heads", 4)
        if "head_dim" in kw:
            kw["head_dim"] = COMMON["qk_rope_head_dim"]
    types = getattr(base, "layer_types", None)
    if (isinstance(types, (list, tuple)) and types and not extra.pop("keep_layer_types", False)
            and not hasattr(base, "use_sliding_window")):
        kinds = list(dict.fromkeys(types))  # one layer of each kind
        kw["layer_types"] = kinds if len(kinds) > 1 else kinds * 2
        kw["num_hidden_layers"] = len(kw["layer_types"])
    extra.pop("keep_layer_types", None)
    if "layer_types" in extra and "num_hidden_layers" not in extra:
        kw["num_hidden_layers"] = len(extra["layer_types"])
    mlp = getattr(base, "mlp_layer_types", None)
    if isinstance(mlp, (list, tuple)) and mlp:
        kinds = list(dict.fromkeys(mlp))
        n = len(extra.get("layer_types", kw.get("layer_types", ()))) or kw.get("num_hidden_layers", 2)
        kw["mlp_layer_types"] = [kinds[i % len(kinds)] for i in range(n)]
    kw.update(extra)
    return AutoConfig.for_model(mt, **kw)


def build(mt: str, spec):
    cfg = tiny_config(mt, spec)
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", experts_implementation="eager")
    except TypeError:  # no experts
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    return model.to(torch.float64).eval()


# --------------------------------------------------------------------------
# float64 truth: keep float64 tensors in float64

F64 = torch.float64


def _keep64(dtype):
    return F64 if dtype is torch.float32 else dtype


@contextlib.contextmanager
def float64():
    """Within: ``softmax(dtype=float32)``, ``.float()``, ``.to(float32)`` and
    ``.type(float32)`` of a float64 tensor stay float64."""
    F, T = torch.nn.functional, torch.Tensor
    saved = dict(F_softmax=F.softmax, torch_softmax=torch.softmax, T_softmax=T.softmax, T_to=T.to,
                 T_float=T.float, T_type=T.type)

    def f_softmax(x, dim=None, _stacklevel=3, dtype=None):
        return saved["F_softmax"](x, dim=dim, dtype=None if x.dtype == F64 else dtype)

    def torch_softmax(x, dim, dtype=None):
        return saved["torch_softmax"](x, dim, dtype=None if x.dtype == F64 else dtype)

    def t_softmax(self, dim, dtype=None):
        return saved["T_softmax"](self, dim, dtype=None if self.dtype == F64 else dtype)

    def t_to(self, *args, **kwargs):
        if self.dtype == F64:
            args = tuple(_keep64(a) if isinstance(a, torch.dtype) else a for a in args)
            if "dtype" in kwargs:
                kwargs["dtype"] = _keep64(kwargs["dtype"])
        return saved["T_to"](self, *args, **kwargs)

    def t_float(self, *args, **kwargs):
        return self if self.dtype == F64 else saved["T_float"](self, *args, **kwargs)

    def t_type(self, *args, **kwargs):
        if self.dtype == F64 and args and args[0] in (torch.float32, "torch.FloatTensor"):
            return self
        return saved["T_type"](self, *args, **kwargs)

    F.softmax, torch.softmax, T.softmax = f_softmax, torch_softmax, t_softmax
    T.to, T.float, T.type = t_to, t_float, t_type
    try:
        yield
    finally:
        F.softmax, torch.softmax, T.softmax = saved["F_softmax"], saved["torch_softmax"], saved["T_softmax"]
        T.to, T.float, T.type = saved["T_to"], saved["T_float"], saved["T_type"]


# --------------------------------------------------------------------------
# the pack: a compaction rollout and a GRPO group


def _tokens(gen, n):
    return torch.randint(4, VOCAB, (n,), generator=gen).tolist()


def rollouts():
    """A compaction rollout (two turns, a summary call, a context resumed
    from the system prompt, marker 3 and the summary, one more turn) and a
    GRPO group of three two-turn rollouts answering one prompt."""
    g = torch.Generator().manual_seed(5)
    sys_, task = _tokens(g, 5), _tokens(g, 4)
    a, tool, b = _tokens(g, 4), _tokens(g, 4), _tokens(g, 4)
    summ, c, tool2, d = _tokens(g, 4), _tokens(g, 3), _tokens(g, 3), _tokens(g, 3)
    h = sys_ + task
    out = [{"id": "compaction", "calls": [
        {"context": h, "completion": a},
        {"context": h + a + tool, "completion": b},
        {"context": h + a + tool + b + [3], "completion": summ},
        {"context": sys_ + [3] + summ + b, "completion": c},
        {"context": sys_ + [3] + summ + b + c + tool2, "completion": d},
    ]}]
    prompt = _tokens(g, 8)
    for i in range(3):
        a, b = _tokens(g, 3 + i), _tokens(g, 3)
        out.append({"id": f"grpo-{i}", "group": "g", "calls": [
            {"context": prompt, "completion": a},
            {"context": prompt + a + _tokens(g, 2), "completion": b},
        ]})
    return out


@pytest.fixture(scope="module")
def data():
    treeattn.hf.register()
    rs = rollouts()
    (pack,) = treeattn.pack(rs)
    # A tree: several roots, shared prefixes, depths deeper than the window.
    assert (pack.position_ids == 0).sum() >= 2 and int(pack.position_ids.max()) >= 20
    assert len(pack) < sum(len(c["context"]) + len(c["completion"]) for r in rs for c in r["calls"])
    return rs, pack


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: tiny models, and a shared two-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def per_call_truth(model, rs, pack):
    """Every loss entry's log-prob from its call run alone, eager, float64."""
    model.set_attn_implementation("eager")
    calls = [c for r in rs for c in r["calls"]]
    cache = {}
    out = torch.empty(pack.loss_rows.numel(), dtype=F64)
    for t, (ci, off) in enumerate(zip(pack.loss_call.tolist(), pack.loss_offset.tolist())):
        c = calls[ci]
        if ci not in cache:
            seq = torch.tensor(c["context"] + c["completion"])[None]
            cache[ci] = torch.log_softmax(model(input_ids=seq, use_cache=False).logits[0], -1)
        out[t] = cache[ci][len(c["context"]) - 1 + off, c["completion"][off]]
    return out


def packed(model, pack, spec):
    """The user's call: treeattn on the model, target_logprobs of the pack
    (with logits= where the chunked head refuses the model)."""
    model.set_attn_implementation("treeattn")
    if getattr(spec, "head", None):
        with pytest.raises(ValueError, match=spec.head):
            treeattn.hf.target_logprobs(model, pack)
        logits = model(input_ids=pack.tokens[None], position_ids=pack.position_ids[None], kv_end=pack.kv_end,
                       use_cache=False).logits[0]
        return treeattn.hf.target_logprobs(model, pack, logits)
    return treeattn.hf.target_logprobs(model, pack)


@contextlib.contextmanager
def seen_variants(monkeypatch):
    """The variants the hook computes during the block."""
    seen = set()
    variants, op = treeattn.hf._variants, treeattn.hf.tree_attention

    def spy(module, kwargs):
        w, s, k = variants(module, kwargs)
        seen.update(n for n, x in ((W, w), (S, s), (K, k)) if x is not None)
        return w, s, k

    def spy_op(q, k, v, *args, **kwargs):
        if v.shape[-1] != q.shape[-1]:
            seen.add(V)
        return op(q, k, v, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(treeattn.hf, "_variants", spy)
        m.setattr(treeattn.hf, "tree_attention", spy_op)
        yield seen


# family → (model, truth): the negative controls reuse the exact test's model
_exact_runs: Dict[str, tuple] = {}


def exact_run(mt, data):
    if mt not in _exact_runs:
        rs, pack = data
        model = build(mt, FAMILIES[mt])
        with torch.no_grad(), float64():
            truth = per_call_truth(model, rs, pack)
        _exact_runs[mt] = (model, truth)
    return _exact_runs[mt]


# --------------------------------------------------------------------------
# the tests


def test_table_covers_every_causal_lm_family():
    """The table has exactly transformers' causal-LM model types: a family
    added or removed by an upgrade is named here."""
    ours, theirs = set(FAMILIES), set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    version = transformers.__version__
    assert not theirs - ours, f"transformers {version} families not in the table: {sorted(theirs - ours)}"
    assert not ours - theirs, f"table families unknown to transformers {version}: {sorted(ours - theirs)}"
    counts = {}
    for spec in FAMILIES.values():
        counts[type(spec).__name__] = counts.get(type(spec).__name__, 0) + 1
    print(f"transformers {transformers.__version__} (table measured with {TRANSFORMERS}): {counts}")


EXACT = sorted(mt for mt, s in FAMILIES.items() if isinstance(s, Exact))
REFUSED = sorted(mt for mt, s in FAMILIES.items() if isinstance(s, Refused)
                 or (isinstance(s, OutOfScope) and s.refused))
UNCLEAR = sorted(mt for mt, s in FAMILIES.items() if isinstance(s, Unclear))
CONTROLS = [(mt, v) for mt in EXACT for v in FAMILIES[mt].variants if v != V]


@pytest.mark.parametrize("mt", EXACT)
def test_exact(mt, data, monkeypatch):
    rs, pack = data
    spec = FAMILIES[mt]
    model, truth = exact_run(mt, data)
    with torch.no_grad(), float64(), seen_variants(monkeypatch) as seen:
        lp = packed(model, pack, spec)
    err = float((lp - truth).abs().max())
    assert err <= BOUND, f"{mt}: max |Δ log p| = {err:.3g} against each call alone (eager, float64)"
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    if cap is not None:
        seen.add(FS)
    assert seen == set(spec.variants), f"{mt}: the hook computed {sorted(seen)}, the table says {sorted(spec.variants)}"


@pytest.mark.parametrize("mt,variant", CONTROLS, ids=[f"{m}-{v}" for m, v in CONTROLS])
def test_dropping_a_variant_is_wrong(mt, variant, data, monkeypatch):
    """Negative control: the same pack with one variant dropped (and the
    hook's guard against mask-only windows off) is off by > MATTERS — the
    tiny model and the pack make the variant matter."""
    rs, pack = data
    spec = FAMILIES[mt]
    model, truth = exact_run(mt, data)
    variants = treeattn.hf._variants

    def drop(module, kwargs):
        w, s, k = variants(module, kwargs)
        return (None if variant == W else w), (None if variant == S else s), (None if variant == K else k)

    monkeypatch.setattr(treeattn.hf, "_variants", drop)
    monkeypatch.setattr(treeattn.hf, "_mask_only_pattern", lambda module, window: None)
    if variant == FS:
        # c·tanh(z/c) with c = 1e9 is z to 1e-18: the cap dropped (the
        # model and the chunked head both read the config).
        cfg = model.config.get_text_config()
        assert cfg.final_logit_softcapping is not None
        monkeypatch.setattr(cfg, "final_logit_softcapping", 1e9)
    with torch.no_grad(), float64():
        lp = packed(model, pack, spec)
    err = float((lp - truth).abs().max())
    assert err > MATTERS, f"{mt} without {variant}: max |Δ log p| = {err:.3g}, the variant does not matter here"


@pytest.mark.parametrize("mt", REFUSED)
def test_refused(mt, data):
    _, pack = data
    spec = FAMILIES[mt]
    model = build(mt, spec)
    match = spec.refused if isinstance(spec, OutOfScope) else spec.match
    model.set_attn_implementation("treeattn")
    with torch.no_grad(), pytest.raises(ValueError, match=match):
        treeattn.hf.target_logprobs(model, pack)


@pytest.mark.parametrize("mt", UNCLEAR)
def test_unclear_error(mt, data):
    """Known defects: an error that does not come from treeattn (the table
    says why). A change here — a clear refusal, or numbers — must update
    the table (and docs/limits.md)."""
    _, pack = data
    spec = FAMILIES[mt]
    model = build(mt, spec)
    model.set_attn_implementation("treeattn")
    with torch.no_grad(), pytest.raises(spec.error, match=spec.match):
        treeattn.hf.target_logprobs(model, pack)


_REFUSED_WHY = {
    PACKED_ORDER: "refused: the decoder embeds positions 0 … L−1 of the packed order, ignoring position_ids",
}


def limits_table() -> str:
    """The markdown table of docs/limits.md (``python -c "import
    test_families as t; print(t.limits_table())"`` from python/tests)."""
    rows = ["| family | on a tree pack | variants computed / reason |", "|---|---|---|"]
    for mt in sorted(FAMILIES):
        s = FAMILIES[mt]
        if isinstance(s, Exact):
            parts = [", ".join(v.replace("_", " ") for v in s.variants)] if s.variants else []
            if s.head:
                parts.append(f"target_logprobs' chunked head refuses it ({s.note}): pass logits=")
            elif s.note:
                parts.append(s.note)
            rows.append(f"| {mt} | exact | {'; '.join(parts) or '—'} |")
        elif isinstance(s, Refused):
            rows.append(f"| {mt} | refused | {s.reason} |")
        elif isinstance(s, Unclear):
            rows.append(f"| {mt} | fails ({s.error.__name__}) | {s.reason} |")
        else:
            why = s.reason + (f"; {_REFUSED_WHY[s.refused]}" if s.refused else "")
            rows.append(f"| {mt} | out of scope | {why} |")
    return "\n".join(rows)


def test_limits_doc_has_the_table():
    """docs/limits.md carries this file's table, row for row."""
    import pathlib

    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "limits.md").read_text()
    missing = [row for row in limits_table().splitlines()[2:] if row not in doc]
    assert not missing, "docs/limits.md lacks rows (regenerate with limits_table()):\n" + "\n".join(missing[:10])


@pytest.mark.parametrize("mt,cfg", [
    ("qwen2_moe", dict(sliding_window=64)),
    ("phimoe", dict(sliding_window=64)),
    ("llama4_text", dict(attention_chunk_size=64)),
])
def test_mask_only_window_deeper_than_the_pack_is_exact(mt, cfg, data):
    """The refusal of a window (or chunk) that lives only in transformers'
    mask applies only when a row is at least as deep as it: below that the
    mask is plain causal, and the family is exact."""
    rs, pack = data
    spec = dataclasses.replace(FAMILIES[mt], cfg={**(FAMILIES[mt].cfg or {}), **cfg})
    model = build(mt, spec)
    assert int(pack.position_ids.max()) < 64
    with torch.no_grad(), float64():
        truth = per_call_truth(model, rs, pack)
        lp = packed(model, pack, spec)
    assert float((lp - truth).abs().max()) <= BOUND


def test_bookkeeping_keywords_are_inert(data):
    """``output_router_logits`` and ``num_items_in_batch`` (transformers'
    TransformersKwargs: MoE router bookkeeping, the Trainer's loss
    normalizer) reach the attention function and change nothing."""
    _, pack = data
    model = build("mixtral", FAMILIES["mixtral"])
    model.set_attn_implementation("treeattn")
    call = dict(input_ids=pack.tokens[None], position_ids=pack.position_ids[None], kv_end=pack.kv_end,
                use_cache=False)
    with torch.no_grad():
        ref = model(**call).logits
        got = model(**call, output_router_logits=True, num_items_in_batch=torch.tensor(7)).logits
    assert torch.equal(got, ref)
