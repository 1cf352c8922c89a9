"""``hf:MODEL_TYPE``: a small Hugging Face transformers model built from its config class.

No download: the config class's defaults, shrunk (2 layers, width 32, vocabulary 100), with
``--config KEY=VALUE`` on top, and random weights. Attention is eager, so the softmax is an
op of its own. The head is the one people train: the model type's language-model head
(seq2seq, speech seq2seq - Whisper -, masked, then causal LM), else its image classifier (ViT;
not for a model with a text tower, such as CLIP, trained whole), else the bare model.
"""

from __future__ import annotations

import ast
import copy
import difflib
from collections.abc import Sequence
from typing import Any

import torch

from ampaudit.core.errors import LoadError, UsageError
from ampaudit.graph.forward import describe_exception

# Field -> small value, under transformers' standard names (each config maps them to its own
# through attribute_map: n_layer for GPT-2, d_model for T5). Only the fields a config has are set.
SMALL = {
    "num_hidden_layers": 2, "num_decoder_layers": 2, "encoder_layers": 2, "decoder_layers": 2,
    "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
    "encoder_attention_heads": 2, "decoder_attention_heads": 2,
    "intermediate_size": 64, "d_ff": 64, "d_inner": 64, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
    "vocab_size": 100, "max_position_embeddings": 64, "relative_attention_num_buckets": 8,
    "image_size": 32, "patch_size": 8, "num_mel_bins": 16, "max_source_positions": 16, "max_target_positions": 16,
    "rotary_dim": 8,  # GPT-J, CodeGen: rotary dims within a 16-dim head (their default 64 is not)
    "window_size": 1,  # Swin: its default 7 is wider than a small image's 4x4 patches, which it cannot take
    # DeepSeek-V3's attention: its rotary dims are the head's (16, not 64: the default inputs
    # failed on a shape mismatch), low-rank q and kv, and 8 routed experts of width 32 (256 x 2048)
    "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16, "kv_lora_rank": 16, "q_lora_rank": 16,
    "n_routed_experts": 8, "moe_intermediate_size": 32,
}
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
              "cls_token_id", "mask_token_id")


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``["n_layer=4", "activation_function='relu'"]`` -> {"n_layer": 4, ...}; a value that is
    not a Python literal stays a string."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise UsageError(f"--config {item!r}: expected KEY=VALUE, such as n_layer=4")
        try:
            out[key] = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            out[key] = text.strip()
    return out


def _config_class(model_type: str):
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:
        raise LoadError(f"hf:{model_type} needs transformers: pip install transformers") from None
    if model_type not in CONFIG_MAPPING:
        known = sorted(CONFIG_MAPPING.keys())
        close = difflib.get_close_matches(model_type, known, n=3)
        hint = f"did you mean {', '.join(close)}?" if close else "e.g. gpt2, llama, bert, t5"
        raise LoadError(f"hf:{model_type}: unknown transformers model type ({hint})")
    return CONFIG_MAPPING[model_type]


def _head(config) -> type[torch.nn.Module]:
    from transformers.models.auto import modeling_auto as auto

    kinds = [auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING, auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING,
             auto.MODEL_FOR_MASKED_LM_MAPPING, auto.MODEL_FOR_CAUSAL_LM_MAPPING,
             auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING, auto.MODEL_MAPPING]
    if not config.is_encoder_decoder:
        kinds = kinds[2:]  # WhisperForCausalLM is the decoder alone: not what Whisper trains
    if hasattr(config, "text_config"):  # CLIP, SigLIP: trained whole, not as an image classifier
        kinds = [k for k in kinds if k is not auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING]
    for mapping in kinds:
        if type(config) in mapping:
            found = mapping[type(config)]
            # a tuple where transformers maps one config to several heads (DeiT: the classifier,
            # then the one with a distillation teacher): the first is the plain one
            return found[0] if isinstance(found, tuple) else found
    raise LoadError(f"hf:{config.model_type}: transformers has no model class for {type(config).__name__}")


def _settable(config: Any, name: str) -> bool:
    """Whether ``config`` has a field ``name`` a constructor may set: Falcon's ``head_dim`` is
    a property computed from the others, and setting it raised; XLNet's
    ``max_position_embeddings`` and Funnel's ``num_hidden_layers`` have setters that refuse any
    value (NotImplementedError), so hf:xlnet and hf:funnel did not build."""
    attribute = getattr(type(config), name, None)
    if not hasattr(config, name):
        return False
    if isinstance(attribute, property):
        if attribute.fset is None:
            return False
        try:  # its own value, on a copy: a setter that refuses it refuses any
            attribute.fset(copy.copy(config), getattr(config, name))
        except Exception:
            return False
    return True


def _small_fields(default: Any, aliases: dict[str, str], stages: bool = False) -> dict[str, Any]:
    """``SMALL``'s values for the fields ``default`` (a config) has and may take them: of the
    same kind as its own - Swin's ``num_heads`` is a list per stage, which a number fails.
    ``stages``: a model built in stages (ConvNeXt, ResNet, RegNet) gets one block a stage and
    channels a 16th as wide - else a full-size ResNet-50, 23.5M parameters."""
    fields = {}
    for key, value in SMALL.items():
        name = aliases.get(key, key)
        if _settable(default, name) and isinstance(getattr(default, name), type(value)):
            fields[name] = value
    depths = getattr(default, "depths", None)
    if stages and isinstance(depths, (list, tuple)) and depths:
        count = aliases.get("num_hidden_layers", "num_hidden_layers")
        if fields.get(count) is not None and getattr(default, count) == len(depths):
            del fields[count]  # the stage count goes with the per-stage lists: set alone, they disagree
        fields["depths"] = [1] * len(depths)
        fields.pop("patch_size", None)  # its stem's own: each stage halves, a 32-pixel image after an 8x stem ran out
        sizes = getattr(default, "hidden_sizes", None)
        if isinstance(sizes, (list, tuple)) and all(isinstance(h, int) for h in sizes):
            fields["hidden_sizes"] = [max(8, h // 16) for h in sizes]
            fields.pop("hidden_size", None)
    return fields


def _token_ids_within(default: Any, aliases: dict[str, str], fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` with the special tokens of the full vocabulary, which would index past the
    small one, set to 0."""
    vocab = fields.get(aliases.get("vocab_size", "vocab_size"))
    for name in _TOKEN_IDS:
        value = getattr(default, name, None)
        if isinstance(vocab, int) and isinstance(value, int) and value >= vocab and name not in fields:
            fields[name] = 0
    return fields


def build_hf(model_type: str, overrides: Sequence[str] = ()) -> tuple[torch.nn.Module, str]:
    """The model and how it was built (``GPT2LMHeadModel(GPT2Config(n_embd=32, ...))``): small
    stages first where the config has them, as the small config alone where those do not build
    (BiT's group norms want wider channels)."""
    config_class = _config_class(model_type)
    default = config_class()
    aliases = getattr(default, "attribute_map", {}) or {}
    given = parse_overrides(overrides)
    for key in given:
        real = aliases.get(key, key)
        if not hasattr(default, real):
            close = difflib.get_close_matches(real, [k for k in vars(default) if not k.startswith("_")], n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise UsageError(f"--config {key}: {config_class.__name__} has no field {key!r}{hint}")
    tries = (True, False) if isinstance(getattr(default, "depths", None), (list, tuple)) else (False,)
    for stages in tries:
        fields = _small_fields(default, aliases, stages)
        fields.update({aliases.get(k, k): v for k, v in given.items()})
        label = _complete(default, aliases, fields, config_class.__name__)
        try:
            config = config_class(**fields)
            config._attn_implementation = "eager"
            head = _head(config)
            return head(config), f"{head.__name__}({label})"
        except (LoadError, UsageError):
            raise
        except Exception as exc:
            if stages:
                continue
            raise LoadError(f"hf:{model_type}: building {label} raised {describe_exception(exc)} "
                            "(set fields with --config KEY=VALUE)") from exc
    raise AssertionError("unreachable: the last try raises")


def _complete(default: Any, aliases: dict[str, str], fields: dict[str, Any], name: str) -> str:
    """``fields`` completed in place - GPT-Neo's attention pattern, each sub-config's small
    fields, the special tokens within the small vocabulary - and the label the user reads."""
    layers = fields.get(aliases.get("num_hidden_layers", "num_hidden_layers"))
    if hasattr(default, "attention_types") and isinstance(layers, int) and layers % 2 == 0 \
            and "attention_types" not in fields:  # GPT-Neo: one (global, local) pattern per two layers
        fields["attention_types"] = [[["global", "local"], layers // 2]]
    for sub_name in getattr(default, "sub_configs", None) or {}:  # CLIP, SigLIP: a text and a vision tower
        sub = getattr(default, sub_name, None)
        if hasattr(sub, "to_dict") and sub_name not in fields:
            sub_aliases = getattr(sub, "attribute_map", {}) or {}
            fields[sub_name] = _token_ids_within(sub, sub_aliases, _small_fields(sub, sub_aliases))
    label = f"{name}({', '.join(f'{k}={v!r}' for k, v in sorted(fields.items()))})"
    _token_ids_within(default, aliases, fields)
    return label
