"""The kv-scales hypothesis: an engine whose KV cache is fp8 with per-layer scales (its noise budget emulates
it: reference/emulate.py `KVCacheFP8`) stores each layer's K and V as e4m3(x / scale); checks/compute/kv_scales.py
judges every layer's k_scale and v_scale against the float32 reference's own K (after RoPE) and V of the prompt.
The emulated run uses the same scales, so a scale that clips or zeroes is not seen by engine-vs-reference: it is
named here."""

from __future__ import annotations

from ..checks.base import Finding
from .session import Session, Skip


def h_kv_scales(s: Session) -> list[Finding]:
    from ..checks.compute.kv_scales import finding, fit

    b = s.budget()
    kv = getattr(b.emulate, "kv_fp8", None)
    if kv is None:
        raise Skip(f"the engine's KV cache is not fp8 with per-layer scales (its arithmetic: {b.words})")
    if kv.tile:
        raise Skip("fp8_ds_mla sets each 128-value tile's scale from the tile's own largest |value| (amax / 448): "
                   "no deployment scale to judge")

    def make():
        with s.pinned_threads():
            _, caps = s.model("float32").forward(s.tokens(), capture={"Kcur-*", "Vcur-*"},
                                                 extra=s.replayed_choices())
        return caps

    caps = s.once("kv-activations", make)
    mla = s.config().mla is not None  # one cache row [latent, k_pe] per token, quantized with the layer's k_scale
    fits = []
    for il, scales in enumerate(kv.scales):
        if scales is None or f"Kcur-{il}" not in caps:
            continue
        fits.append(fit(caps[f"Kcur-{il}"], scales[0], kv.rounding, layer=il, which="k_scale"))
        if not mla and f"Vcur-{il}" in caps:
            fits.append(fit(caps[f"Vcur-{il}"], scales[1], kv.rounding, layer=il, which="v_scale"))
    if not fits:
        raise Skip("the reference captured no K or V of a layer with an fp8 cache")
    return [finding(s.inputs.engine, fits, b.words)]
