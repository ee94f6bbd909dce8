"""Hugging Face causal LM of a gdn2 model, standalone.

This file is copied into every exported model folder and imports nothing from gdn2, so that
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` works where gdn2 is not
installed. Parameter names are gdn2's (``transformer.h.<i>.mixer.q_proj.weight``, ...), so its
``model.safetensors`` is gdn2's state dict as it is.

Math (per GDN-2 head, state ``S`` [K, V] in fp32, q and k L2-normalised, ``scale = K**-0.5``)::

    S <- Diag(exp(g_t)) S;  u_t = w_t * v_t - S^T (b_t * k_t);  S <- S + k_t u_t^T;  o_t = scale * S^T q_t

A gate "per head" (``gdn2_decay`` / ``gdn2_erase`` / ``gdn2_write``: "head") is one value per head
repeated over the head's channels; tied gates (``gdn2_tied_gates``) are one projection per value head
whose gate is both b and w (doubled with ``allow_neg_eigval``, both of them).

Decoding keeps a real recurrent cache (:class:`GDN2InferenceCache`): the GDN-2 states, the short
convolutions' last inputs, and the keys and values of the attention layers (the last ``window`` of
them with a sliding window), so cached decoding gives the logits of uncached decoding. Left padding
(``attention_mask``) is honoured: a padded position changes no state and is attended by no query.
On CUDA, when gdn2 is importable, its Triton kernels run the operators; elsewhere the plain PyTorch
code below does.
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.utils import ModelOutput

from .configuration_gdn2 import GDN2Config

try:  # gdn2's kernels, where gdn2 is installed
    from gdn2.ops import chunk_gdn2 as _chunk_gdn2
    from gdn2.ops import sliding_window_attention as _sliding_window_attention
except Exception:  # noqa: BLE001 - any failure means: use the PyTorch path
    _chunk_gdn2 = _sliding_window_attention = None

L2NORM_EPS = 1e-6


def _kernels_for(x: torch.Tensor) -> bool:
    return _chunk_gdn2 is not None and x.is_cuda


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + L2NORM_EPS)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.weight, self.eps)


class MLP(nn.Module):
    """SwiGLU: ``w3(silu(w1 x) * w2 x)``."""

    def __init__(self, config: GDN2Config) -> None:
        super().__init__()
        d, i = config.n_embd, config.intermediate_size
        self.w1 = nn.Linear(d, i, bias=False)
        self.w2 = nn.Linear(d, i, bias=False)
        self.w3 = nn.Linear(i, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w3(F.silu(self.w1(x)) * self.w2(x))


@dataclass
class GDN2InferenceCache:
    """What decoding carries from one call to the next, per layer; ``seen`` columns consumed so far and
    ``valid_count`` [B] the real (not padded) tokens of each row among them."""

    layers: list
    seen: int
    valid_count: torch.Tensor


def _rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate-half RoPE of x [B,T,H,D] at integer ``positions`` [B,T], in fp32."""
    D = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D))
    angles = positions.to(torch.float32)[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]
    xf = x.float() if x.dtype != torch.float64 else x
    half = D // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * angles.cos().to(xf.dtype) + rotated * angles.sin().to(xf.dtype)).to(x.dtype)


class Attention(nn.Module):
    """Causal attention over the last ``window`` keys (None: all), RoPE, grouped KV heads."""

    def __init__(self, config: GDN2Config) -> None:
        super().__init__()
        self.n_head, self.n_kv, self.head_size = config.n_head, config.n_query_groups, config.head_size
        self.window, self.rope_base = config.sliding_window, config.rope_base
        self.qkv = nn.Linear(config.n_embd, (self.n_head + 2 * self.n_kv) * self.head_size, bias=False)
        self.proj = nn.Linear(self.n_head * self.head_size, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                cache: Optional[dict]) -> torch.Tensor:
        B, T, _ = x.shape
        H, Hkv, D = self.n_head, self.n_kv, self.head_size
        q, k, v = self.qkv(x).split([H * D, Hkv * D, Hkv * D], dim=-1)
        q, k, v = q.reshape(B, T, H, D), k.reshape(B, T, Hkv, D), v.reshape(B, T, Hkv, D)
        q, k = _rope(q, positions, self.rope_base), _rope(k, positions, self.rope_base)
        if cache is None and bool(valid.all()) and _kernels_for(x):
            o = _sliding_window_attention(q, k, v, self.window)
            return self.proj(o.reshape(B, T, H * D))
        keys, values, kpos, kvalid = k, v, positions, valid
        if cache is not None and "k" in cache:
            keys, values = torch.cat([cache["k"], k], dim=1), torch.cat([cache["v"], v], dim=1)
            kpos, kvalid = torch.cat([cache["pos"], positions], dim=1), torch.cat([cache["valid"], valid], dim=1)
        if cache is not None:  # what a later query can still see
            keep = keys.shape[1] if self.window is None else min(self.window, keys.shape[1])
            cache.update(k=keys[:, -keep:], v=values[:, -keep:], pos=kpos[:, -keep:], valid=kvalid[:, -keep:])
        rep = H // Hkv
        kk = keys.repeat_interleave(rep, dim=2).transpose(1, 2).float()
        vv = values.repeat_interleave(rep, dim=2).transpose(1, 2).float()
        scores = q.transpose(1, 2).float() @ kk.transpose(-1, -2) * D ** -0.5  # [B,H,T,S]
        qp, kp = positions[:, None, :, None], kpos[:, None, None, :]
        visible = (kp <= qp) & kvalid[:, None, None, :]
        if self.window is not None:
            visible = visible & (kp > qp - self.window)
        scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
        o = (scores.softmax(-1) @ vv).transpose(1, 2).to(x.dtype)
        return self.proj(o.reshape(B, T, H * D))


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        of = o.float()
        y = of * torch.rsqrt(of.square().mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (y * F.silu(gate.float())).to(o.dtype)


def _causal_conv_silu(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """silu of the causal depthwise convolution of x [B,T,C] after the inputs ``tail`` [B,ks-1,C]."""
    ks, T = weight.shape[-1], x.shape[1]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = weight[:, 0, :].to(x.dtype).to(acc)
    full = torch.cat([tail.to(x.dtype), x], dim=1)
    y = x.to(acc) * w[:, ks - 1]
    for j in range(1, ks):
        y = y + full[:, ks - 1 - j: ks - 1 - j + T].to(acc) * w[:, ks - 1 - j]
    return F.silu(y).to(x.dtype)


def _recurrence(q, k, v, g, b, w, state):
    """The GDN-2 recurrence token by token; q, k, g, b [B,T,HV,K] (heads already broadcast), v, w
    [B,T,HV,V], state [B,HV,K,V] (fp32 or fp64). Returns o [B,T,HV,V] and the final state."""
    scale = q.shape[-1] ** -0.5
    S = state
    outs = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None]
        u = w[:, t] * v[:, t] - torch.einsum("bhkv,bhk->bhv", S, b[:, t] * k[:, t])
        S = S + k[:, t][..., None] * u[:, :, None, :]
        outs.append(scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o, S


class GatedDeltaNet2(nn.Module):
    def __init__(self, config: GDN2Config) -> None:
        super().__init__()
        c = config
        self.H, self.HV, self.K, self.V = c.gdn2_num_heads, c.gdn2_num_v_heads, c.gdn2_head_dim, c.gdn2_head_v_dim
        self.key_dim, self.value_dim, self.conv_size = self.H * self.K, self.HV * self.V, c.gdn2_conv_size
        self.b_scale = 2.0 if c.allow_neg_eigval else 1.0
        self.tied = c.gdn2_tied_gates
        decay_head, erase_head, write_head = (c.gdn2_decay == "head", c.gdn2_erase == "head", c.gdn2_write == "head")
        # channels each value of g, b and w covers: 1 per channel, the head dim per head
        self.spans = (self.K if decay_head else 1, self.K if erase_head else 1, self.V if write_head else 1)
        decay_units = self.H if decay_head else self.key_dim
        erase_units = self.HV if self.tied else self.H if erase_head else self.key_dim
        d, r = c.n_embd, c.gdn2_gate_rank
        self.q_proj = nn.Linear(d, self.key_dim, bias=False)
        self.k_proj = nn.Linear(d, self.key_dim, bias=False)
        self.v_proj = nn.Linear(d, self.value_dim, bias=False)
        self.q_conv1d = nn.Conv1d(self.key_dim, self.key_dim, self.conv_size, groups=self.key_dim, bias=False)
        self.k_conv1d = nn.Conv1d(self.key_dim, self.key_dim, self.conv_size, groups=self.key_dim, bias=False)
        self.v_conv1d = nn.Conv1d(self.value_dim, self.value_dim, self.conv_size, groups=self.value_dim, bias=False)
        self.f_proj = nn.Sequential(nn.Linear(d, r, bias=False), nn.Linear(r, decay_units, bias=False))
        self.b_proj = nn.Linear(d, erase_units, bias=False)
        if not self.tied:
            self.w_proj = nn.Linear(d, self.HV if write_head else self.value_dim, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(decay_units, dtype=torch.float32))
        self.g_proj = nn.Sequential(nn.Linear(d, r, bias=False), nn.Linear(r, self.value_dim, bias=True))
        self.o_norm = GatedRMSNorm(self.V, c.norm_eps)
        self.o_proj = nn.Linear(self.value_dim, d, bias=False)

    def forward(self, x: torch.Tensor, valid: torch.Tensor, cache: Optional[dict]) -> torch.Tensor:
        B, T, _ = x.shape
        H, HV, K, V = self.H, self.HV, self.K, self.V
        mask = valid[..., None].to(x.dtype)
        convs = []
        for name, proj, conv in (("q", self.q_proj, self.q_conv1d), ("k", self.k_proj, self.k_conv1d),
                                 ("v", self.v_proj, self.v_conv1d)):
            pre = proj(x) * mask  # a padded position feeds nothing into the convolution
            tail = cache.get(name) if cache is not None else None
            if tail is None:
                tail = pre.new_zeros(B, self.conv_size - 1, pre.shape[-1])
            convs.append(_causal_conv_silu(pre, conv.weight, tail))
            if cache is not None:
                cache[name] = torch.cat([tail.to(pre.dtype), pre], dim=1)[:, -(self.conv_size - 1):]
        q, k, v = convs
        decay = -self.A_log.float().exp().repeat_interleave(self.dt_bias.shape[0] // H)
        g = decay * F.softplus(self.f_proj(x).float() + self.dt_bias) * valid[..., None]  # no decay when padded
        b = torch.sigmoid(self.b_proj(x)) * self.b_scale
        w = b if self.tied else torch.sigmoid(self.w_proj(x))
        # a gate per head covers its head's channels
        g, b, w = (t if span == 1 else t.repeat_interleave(span, dim=-1) for t, span in zip((g, b, w), self.spans))
        k = k * mask  # and no write: the state is left as it was
        q, k, g = (t.reshape(B, T, H, K) for t in (q, k, g))
        b = b.reshape(B, T, -1, K)  # H heads, or HV for a tied gate
        v, w = v.reshape(B, T, HV, V), w.reshape(B, T, HV, V)
        state = cache.get("state") if cache is not None else None
        if _kernels_for(x):
            o, final = _chunk_gdn2(q, k, v, g, b, w, initial_state=state, output_final_state=cache is not None,
                                   use_qk_l2norm_in_kernel=True)
        else:
            compute = torch.float64 if v.dtype == torch.float64 else torch.float32
            qe, ke, ge, be = (t.repeat_interleave(HV // t.shape[2], dim=2).to(compute)
                              for t in (_l2norm(q), _l2norm(k), g, b))
            if state is None:
                state = torch.zeros(B, HV, K, V, dtype=compute, device=x.device)
            o, final = _recurrence(qe, ke, v.to(compute), ge, be, w.to(compute), state.to(compute))
            o = o.to(x.dtype)
        if cache is not None:
            cache["state"] = final
        o = self.o_norm(o, self.g_proj(x).reshape(B, T, HV, V)).reshape(B, T, self.value_dim)
        return self.o_proj(o)


class Block(nn.Module):
    def __init__(self, config: GDN2Config, layer_idx: int) -> None:
        super().__init__()
        self.kind = "gdn2" if config.is_gdn2_layer(layer_idx) else "attention"
        self.norm_1 = RMSNorm(config.n_embd, config.norm_eps)
        self.mixer = GatedDeltaNet2(config) if self.kind == "gdn2" else Attention(config)
        self.norm_2 = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, positions, valid, cache):
        h = self.norm_1(x)
        h = self.mixer(h, valid, cache) if self.kind == "gdn2" else self.mixer(h, positions, valid, cache)
        x = x + h
        return x + self.mlp(self.norm_2(x))


@dataclass
class GDN2CausalLMOutput(ModelOutput):
    loss: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None
    gdn2_cache: Optional[GDN2InferenceCache] = None


class GDN2PreTrainedModel(PreTrainedModel):
    config_class = GDN2Config
    base_model_prefix = "gdn2"
    _no_split_modules = ["Block"]
    _keep_in_fp32_modules = ["A_log", "dt_bias"]
    _is_stateful = True
    supports_gradient_checkpointing = False

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model keeps its own cache (gdn2_cache), not transformers' key-value caches

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)


class GDN2ForCausalLM(GDN2PreTrainedModel, GenerationMixin):
    def __init__(self, config: GDN2Config) -> None:
        super().__init__(config)
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            h=nn.ModuleList(Block(config, i) for i in range(config.n_layer)),
            ln_f=RMSNorm(config.n_embd, config.norm_eps),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.transformer.wte

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.transformer.wte = value

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids: torch.LongTensor, attention_mask: Optional[torch.Tensor] = None,
                gdn2_cache: Optional[GDN2InferenceCache] = None, use_cache: Optional[bool] = None,
                labels: Optional[torch.LongTensor] = None, return_dict: Optional[bool] = None,
                **kwargs) -> GDN2CausalLMOutput:
        """input_ids [B,T]: the tokens after those ``gdn2_cache`` holds (all of them without a cache).
        ``attention_mask`` [B, cached + T] (or [B,T]): 0 marks left padding. With ``use_cache`` the
        returned ``gdn2_cache`` continues the sequence."""
        B, T = input_ids.shape
        use_cache = self.config.use_cache if use_cache is None else use_cache
        valid = (torch.ones(B, T, dtype=torch.bool, device=input_ids.device) if attention_mask is None
                 else attention_mask[:, -T:].to(device=input_ids.device, dtype=torch.bool))
        if gdn2_cache is None and use_cache:
            gdn2_cache = GDN2InferenceCache([{} for _ in range(self.config.n_layer)], 0,
                                            torch.zeros(B, dtype=torch.long, device=input_ids.device))
        before = gdn2_cache.valid_count[:, None] if gdn2_cache is not None else 0
        positions = (before + valid.long().cumsum(1) - 1).clamp_min(0)
        x = self.transformer.wte(input_ids)
        for i, block in enumerate(self.transformer.h):
            x = block(x, positions, valid, gdn2_cache.layers[i] if gdn2_cache is not None else None)
        logits = self.lm_head(self.transformer.ln_f(x)).float()
        if gdn2_cache is not None:
            gdn2_cache.seen += T
            gdn2_cache.valid_count = gdn2_cache.valid_count + valid.long().sum(1)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        return GDN2CausalLMOutput(loss=loss, logits=logits, gdn2_cache=gdn2_cache if use_cache else None)

    def prepare_inputs_for_generation(self, input_ids: torch.LongTensor, gdn2_cache=None, attention_mask=None,
                                      use_cache=True, **kwargs) -> dict:
        if gdn2_cache is not None:
            input_ids = input_ids[:, gdn2_cache.seen:]  # the cache holds the rest
        return {"input_ids": input_ids, "attention_mask": attention_mask, "gdn2_cache": gdn2_cache,
                "use_cache": use_cache}

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, is_encoder_decoder=False,
                                            num_new_tokens=1):
        model_kwargs = super()._update_model_kwargs_for_generation(
            outputs, model_kwargs, is_encoder_decoder=is_encoder_decoder, num_new_tokens=num_new_tokens)
        model_kwargs["gdn2_cache"] = outputs.gdn2_cache
        return model_kwargs
