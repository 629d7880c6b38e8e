"""Weight moments of weight forensics: count, mean and central moment sums of a tensor's decoded values,
chunk by chunk, in float32 passes with a written rounding bound (below), merged in float64."""

from __future__ import annotations

import ctypes
import math
import threading
from dataclasses import dataclass

import numpy as np
import torch

from . import forensics_native as fx_native  # its NATIVE read at each call: tests switch it off

# ---- the moments of the values, chunk by chunk ------------------------------------------------------
# Cost: this runs on every decoded value of a `verify` pass, so it is two reads of each chunk by the C
# routines of _forensics_native.c (a scan: min, max, sum; then the centered sums), or where that is not
# built, a few float32 torch passes over the chunk in reused buffers, on one torch thread (the calling
# thread's count is set to 1 for the chunk and restored: torch's intra-op threads wait on each other
# for every ~1M-value op, 20-60x slower on a busy 2-core host; verify.py measured it); never a float64
# copy of the values. Both compute the same quantities in rows of ROW values, so the bound below holds
# for either; each is bit-reproducible (the C one for any build: its summation order is fixed in the
# source). Per chunk of n values w:
#   max |w| and finiteness      a min and a max (the C scan flags inf / NaN; in torch they make the min or
#                               max non-finite); only then are the finite values picked out, exactly
#   the chunk mean m            float32 sums of ROW consecutive values, those added in float64
#   d = w - m32 (m rounded to float32), and S_k = sum of d^k for k = 2, 3, 4 the same way
# and the chunk's central moments (about its own mean) are merged into the tensor's in float64 with
# the pairwise update of Pebay (Sandia SAND2008-6212, eqs. 2.1-2.3; Chan, Golub and LeVeque 1979 for
# k = 2). Centering on the chunk's own mean avoids the cancellation of raw moments
# (E[w^4] - 4 E[w] E[w^3] + ...), which loses every digit of the kurtosis of a tensor whose mean is
# large against its spread (a norm weight near 1).
#
# Rounding bound (u = 2^-24, float32's unit roundoff; first order in u): d carries one rounding, and
# d^2, d^3, d^4 another 1, 2, 3 multiplications, so each term d^k is within (k + k')u of the exact
# (w - m32)^k (k' = 1, 2, 3); a float32 sum of ROW terms in any order is within (ROW - 1)u of
# sum |terms| (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 4.4), whatever
# order torch's kernel adds them in; the float64 sums and merges after it add ~2^-53 per operation. So
#   |S_k - exact| <= (ROW + 6) u sum |d|^k = 6.2e-5 sum |d|^k          (ROW = 1024)
#   |chunk mean - exact| <= (ROW - 1) u mean |w| = 6.1e-5 mean |w|,
# and from these (a chunk mean's error also enters M2 through the spread of chunk means, at most
# 2 x 6.1e-5 E|w| sigma): E[w^2] within 3.1e-4 E[w^2], so rms within 1.6e-4 relative and mean / rms
# within 2.2e-4 absolute; the kurtosis (reported, not compared) within ~1e-3 relative where |mean| is
# at most the spread sigma (a factor E|w| / sigma more where the mean dominates). The sibling rule
# works on log2 rms and mean / rms with floors of log2(1.12) = 0.16 binades and 0.12 (sibling_outliers.py): its
# median, MAD and each value moving by those amounts move a robust z by at most
# (2 + z x 2 x 1.4826) x shift / floor, under 0.03 at the limit (~4.4). Only a tensor within 0.03 of
# the limit could change its verdict; the demo's largest z is 0.3 under it (tests/checks/file/test_forensics.py
# checks both, and the statistics against float64: there they agree to ~1e-7). The scale statistics
# are exact (counts of codes). Every sum is in a fixed order (rows of ROW values, then those in
# order), so the numbers are the same run to run and for any torch thread count.
# Range: w^4 overflows float32 from |w| ~ 2^32 and loses its precision in subnormals below 2^-31, so a
# chunk with max |w| outside [2^-20, 2^20] is scaled by a power of two (exact) to max |w| in [1, 2)
# first; terms under 2^-31 max |w| may still lose digits, but they add at most n 2^-126 to a sum of
# at least max |d|^4 (a relative error under 2^-40 for any chunk whose spread is not below 2^-20 of
# its magnitude).
ROW = 1024  # the C file's ROW too
SAFE = (2.0 ** -20, 2.0 ** 20)  # max |w| taken as it is (Range, above); else scaled first
_scratch = threading.local()


def _buffers(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two float32 [n] scratch buffers, reused per thread and device (grown, never shrunk)."""
    key = str(device)
    bufs = getattr(_scratch, "bufs", {})
    _scratch.bufs = bufs
    b = bufs.get(key)
    if b is None or b[0].numel() < n:
        b = bufs[key] = (torch.empty(n, dtype=torch.float32, device=device),
                         torch.empty(n, dtype=torch.float32, device=device))
    return b[0][:n], b[1][:n]


def _min_max(x: torch.Tensor) -> tuple[float, float]:
    """(min, max) of float32 x [n >= 1]; NaN when x holds a NaN. On the CPU numpy's (0.1 ms per 1M
    values against torch.aminmax's 0.16 on this machine's AMD EPYC: it is one of the passes)."""
    if x.device.type == "cpu":
        a = x.numpy()
        return float(a.min()), float(a.max())
    return tuple(float(y) for y in torch.aminmax(x))  # type: ignore[return-value]


def scan(x: torch.Tensor) -> tuple[float, float, float | None, bool]:
    """(min, max, sum or None, every value finite) of float32 x [n >= 1] (contiguous); the sum only
    from the C scan (the torch path sums later, when it knows the chunk needs no scaling)."""
    if fx_native.NATIVE is not None and x.device.type == "cpu":
        out = (ctypes.c_double * 4)()
        fx_native.NATIVE.llmd_fx_scan(x.data_ptr(), x.numel(), out)
        return out[0], out[1], out[2], out[3] == 0.0
    lo, hi = _min_max(x)
    return lo, hi, None, math.isfinite(lo) and math.isfinite(hi)


def _sum(x: torch.Tensor) -> float:
    """sum of float32 x [n]: float32 sums of ROW consecutive values, added in float64 (see above)."""
    k = x.numel() - x.numel() % ROW
    s = float(x[:k].view(-1, ROW).sum(1).sum(dtype=torch.float64)) if k else 0.0
    return s + float(x[k:].sum()) if k < x.numel() else s


@dataclass
class Moments:
    """Count, mean and central moment sums M_k = sum (w - mean)^k (k = 2, 3, 4) of the values seen."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0
    m3: float = 0.0
    m4: float = 0.0

    def merge(self, o: "Moments") -> None:
        """Pebay's pairwise update: self := self united with o."""
        na, nb = self.n, o.n
        if nb == 0:
            return
        if na == 0:
            self.n, self.mean, self.m2, self.m3, self.m4 = o.n, o.mean, o.m2, o.m3, o.m4
            return
        n = na + nb
        dl = o.mean - self.mean
        m4 = (self.m4 + o.m4 + dl ** 4 * na * nb * (na * na - na * nb + nb * nb) / n ** 3
              + 6 * dl * dl * (na * na * o.m2 + nb * nb * self.m2) / n ** 2 + 4 * dl * (na * o.m3 - nb * self.m3) / n)
        m3 = self.m3 + o.m3 + dl ** 3 * na * nb * (na - nb) / n ** 2 + 3 * dl * (na * o.m2 - nb * self.m2) / n
        self.m2 += o.m2 + dl * dl * na * nb / n
        self.mean += dl * nb / n
        self.m3, self.m4, self.n = m3, m4, n

    @staticmethod
    def of(w: torch.Tensor, max_abs: float, total: float | None = None) -> "Moments":
        """The moments of finite float32 w [n] (contiguous) whose largest |w| is max_abs; `total`: its
        sum in the order of _sum, when the scan has it."""
        n = w.numel()
        if n == 0:
            return Moments()
        scale = 1.0
        native = fx_native.NATIVE is not None and w.device.type == "cpu"
        if max_abs > 0 and not SAFE[0] <= max_abs <= SAFE[1]:
            scale = 2.0 ** (math.frexp(max_abs)[1] - 1)  # w / scale: max |w| in [1, 2), exactly
            w = torch.div(w, scale, out=_buffers(n, w.device)[0])
            total = None
        mean = (total if total is not None else _sum(w)) / n
        m32 = float(np.float32(mean))
        if native:
            out = (ctypes.c_double * 3)()
            fx_native.NATIVE.llmd_fx_central(w.data_ptr(), n, m32, out)
            s2, s3, s4 = out
        else:
            d, d2 = _buffers(n, w.device)
            torch.sub(w, m32, out=d)  # d: [n] w - m32 (w may be d itself: elementwise, in place)
            s2 = _sum(torch.mul(d, d, out=d2))
            s3 = _sum(d.mul_(d2))
            s4 = _sum(d2.mul_(d2))
        return Moments.of_sums(n, mean, s2, s3, s4, scale)

    @staticmethod
    def of_sums(n: int, mean: float, s2: float, s3: float, s4: float, scale: float = 1.0) -> "Moments":
        """The moments of n values (divided by `scale`) whose mean is `mean`, from their sums S_k of
        (w - m32)^k, m32 the mean rounded to float32."""
        r = mean - float(np.float32(mean))  # the mean's offset from the center the float32 terms are taken about
        # central sums about the chunk mean m32 + r from the sums about m32
        m2 = s2 - n * r * r
        m3 = s3 - 3 * r * s2 + 2 * n * r ** 3
        m4 = s4 - 4 * r * s3 + 6 * r * r * s2 - 3 * n * r ** 4
        return Moments(n, mean * scale, m2 * scale ** 2, m3 * scale ** 3, m4 * scale ** 4)
