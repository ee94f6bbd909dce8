"""gdn2/layers/gdn2.py, gate granularity: with one tied gate per head the layer is KDA, with a decay per
head too it is Gated DeltaNet, each against its own float64 recurrence written here (values and
gradients), and those recurrences are the GDN-2 operator's oracle with the tied gate broadcast."""

import pytest
import torch
import torch.nn.functional as F

from gdn2.config import Config
from gdn2.layers.gdn2 import GatedDeltaNet2
from gdn2.ops import recurrent_gdn2_reference

L2NORM_EPS = 1e-6  # the operator's q, k normalisation: x / sqrt(sum(x^2) + eps)


def unit(x):
    return x / torch.sqrt(x.square().sum(-1, keepdim=True) + L2NORM_EPS)


def kda_recurrence(q, k, v, alpha, beta, scale):
    """KDA with the state S [K, V]: ``S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T``,
    ``o_t = scale S_t^T q_t``. q, k, alpha [B,T,H,K] (q, k of unit length; alpha in (0, 1] per key
    channel), v [B,T,H,V], beta [B,T,H]. Returns o [B,T,H,V]."""
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    eye = torch.eye(K, dtype=q.dtype)
    outs = []
    for t in range(T):
        kt, bt = k[:, t, :, :, None], beta[:, t, :, None, None]  # [B,H,K,1], [B,H,1,1]
        S = (eye - bt * kt @ kt.mT) @ (alpha[:, t, :, :, None] * S) + bt * kt @ v[:, t, :, None, :]
        outs.append(scale * (S.mT @ q[:, t, :, :, None])[..., 0])
    return torch.stack(outs, 1)


def gated_deltanet_recurrence(q, k, v, alpha, beta, scale):
    """The gated delta rule with the state S [V, K]: ``S_t = alpha_t S_{t-1} (I - beta_t k_t k_t^T) +
    beta_t v_t k_t^T``, ``o_t = scale S_t q_t``. q, k [B,T,H,K] (unit length), v [B,T,H,V], alpha, beta
    [B,T,H]. Returns o [B,T,H,V]. GDN-2's operator keeps S^T: ``S^T <- (I - b k k^T) alpha S^T + k (w v)^T``
    with b = w = beta, the same state."""
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, v.shape[-1], K)
    eye = torch.eye(K, dtype=q.dtype)
    outs = []
    for t in range(T):
        kt, a, bt = k[:, t, :, :, None], alpha[:, t, :, None, None], beta[:, t, :, None, None]
        S = a * S @ (eye - bt * kt @ kt.mT) + bt * v[:, t, :, :, None] @ kt.mT
        outs.append(scale * (S @ q[:, t, :, :, None])[..., 0])
    return torch.stack(outs, 1)


RECURRENCES = {"kda": kda_recurrence, "gdn": gated_deltanet_recurrence}


@pytest.mark.parametrize("kind", list(RECURRENCES))
def test_recurrences_are_the_operator_with_one_tied_gate_broadcast(kind):
    """The operator's oracle with q, k L2-normalised inside, scale K^-0.5, g = log alpha (per key
    channel, or per head repeated over its channels) and b = w = beta repeated over the key and the
    value channels gives the recurrence's output (beta up to 2: the doubled gate of allow_neg_eigval)."""
    B, T, H, K, V = 2, 9, 3, 5, 4
    q, k = torch.randn(B, T, H, K, dtype=torch.float64), torch.randn(B, T, H, K, dtype=torch.float64)
    v = torch.randn(B, T, H, V, dtype=torch.float64)
    alpha = torch.rand(B, T, H, K if kind == "kda" else 1, dtype=torch.float64) * 0.6 + 0.4
    beta = torch.rand(B, T, H, dtype=torch.float64) * 2
    o, _ = recurrent_gdn2_reference(q, k, v, alpha.log().expand(B, T, H, K), beta[..., None].expand(B, T, H, K),
                                    beta[..., None].expand(B, T, H, V), use_qk_l2norm_in_kernel=True)
    decay = alpha if kind == "kda" else alpha[..., 0]
    want = RECURRENCES[kind](unit(q), unit(k), v, decay, beta, K ** -0.5)
    torch.testing.assert_close(o, want, rtol=0, atol=1e-12)


def reference_layer(layer, x, kind):
    """The layer's output written out with its own parameters and the recurrence of ``kind``: short
    convs with SiLU, q and k normalised, alpha = exp(-exp(A_log) softplus(f + dt_bias)) per key channel
    (kda) or per head (gdn; A_log and dt_bias are fp32 parameters), beta = sigmoid(b_proj x) per value head (doubled with allow_neg_eigval),
    value head j reading key head j // (HV / H), then the per-head RMSNorm gated by silu(output gate).
    The decay and the gated norm are computed in fp32, as the layer computes them in any dtype."""
    B, T, _ = x.shape
    H, HV, K, V = layer.num_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim

    def short_conv(proj, conv):
        y = F.linear(x, proj.weight).mT
        return F.silu(F.conv1d(F.pad(y, (conv.weight.shape[-1] - 1, 0)), conv.weight, groups=y.shape[1]).mT)

    q = unit(short_conv(layer.q_proj, layer.q_conv1d).reshape(B, T, H, K))
    k = unit(short_conv(layer.k_proj, layer.k_conv1d).reshape(B, T, H, K))
    v = short_conv(layer.v_proj, layer.v_conv1d).reshape(B, T, HV, V)
    # the log-decay in fp32, as the layer makes it for the operator, whatever the model's dtype
    f = F.linear(F.linear(x, layer.f_proj[0].weight), layer.f_proj[1].weight).float() + layer.dt_bias
    rate = layer.A_log.exp()
    if kind == "kda":
        alpha = torch.exp((-rate[:, None] * F.softplus(f.reshape(B, T, H, K))).double())
    else:
        alpha = torch.exp((-rate * F.softplus(f)).double())
    beta = torch.sigmoid(F.linear(x, layer.b_proj.weight)) * (2.0 if layer.allow_neg_eigval else 1.0)
    q, k, alpha = (t.repeat_interleave(HV // H, dim=2) for t in (q, k, alpha))
    o = RECURRENCES[kind](q, k, v, alpha, beta, K ** -0.5)
    gate = F.linear(F.linear(x, layer.g_proj[0].weight), layer.g_proj[1].weight, layer.g_proj[1].bias)
    o = o.float()  # the gated norm in fp32, as the layer's stage computes it
    o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + layer.o_norm.eps) * layer.o_norm.weight.float()
    o = (o * F.silu(gate.reshape(B, T, HV, V).float())).double()
    return F.linear(o.reshape(B, T, HV * V), layer.o_proj.weight)


# kda as named; gdn with grouped value heads, V = 2K and the doubled gate of allow_neg_eigval
LAYERS = {"kda": ("kda_tiny", {}),
          "gdn": ("gdn_tiny", dict(gdn2_num_v_heads=8, gdn2_expand_v=2.0, allow_neg_eigval=True))}


@pytest.mark.parametrize("kind", list(LAYERS))
def test_layer_with_tied_head_gates_is_its_recurrence(kind):
    name, overrides = LAYERS[kind]
    config = Config.from_name(name, **overrides)
    torch.manual_seed(0)
    layer = GatedDeltaNet2(config).double()
    H, HV = config.gdn2_num_heads, config.gdn2_num_v_heads
    decay_units = H * config.gdn2_head_dim if kind == "kda" else H
    assert layer.b_proj.out_features == HV and not hasattr(layer, "w_proj")  # one gate, erase and write
    assert layer.f_proj[1].out_features == decay_units and layer.dt_bias.shape == (decay_units,)
    with torch.no_grad():  # A_log spread so that the decays are far from 1
        layer.A_log.copy_(torch.linspace(0.0, 2.5, H))
    x = torch.randn(2, 21, config.n_embd, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, 21, config.n_embd, dtype=torch.float64)
    params = [x, *layer.parameters()]
    got = layer(x)
    want = reference_layer(layer, x, kind)
    grads_got = torch.autograd.grad((got * dy).sum(), params)
    grads_want = torch.autograd.grad((want * dy).sum(), params)
    # fp32 rounding apart (the fp32 stages read float64 inputs that differ in their last bits: the chunked
    # operator sums in another order), the same: errors of 1e-7 of the largest value, where a wrong gate
    # is off by percents
    for (pname, _), a, b in zip([("output", got), ("x", x), *layer.named_parameters()],
                                [got, *grads_got], [want, *grads_want]):
        assert (a - b).abs().max() <= 1e-6 * b.abs().max(), pname
