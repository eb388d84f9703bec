"""The divergences a draft is trained with: the teacher's distribution p against the draft's q, per position.

All are computed over the draft vocabulary (the teacher restricted to it and renormalised, as the KL always
was), one value per scored position, fp32:

    kl    KL(p || q)     = sum p log p - sum p log q             (EAGLE-3's; a fused soft-target cross-entropy)
    rkl   KL(q || p)     = sum q (log q - log p)                 (reverse KL: mode-seeking)
    jsd   JS(p, q)       = KL(p || m) / 2 + KL(q || m) / 2,  m = (p + q) / 2
    tv    TV(p, q)       = sum |p - q| / 2 = 1 - alpha           (alpha = sum min(p, q): the acceptance rate of
                                                                  speculative sampling at this position)
    nla   -log alpha                                            (negative log-acceptance: TV's gradient / alpha)
    lk    lambda KL + (1 - lambda) TV,  lambda = exp(-3 alpha) detached   (the adaptive blend of LK losses,
                                                                  arXiv 2602.23881: KL while alpha is small, TV
                                                                  as the draft starts to be accepted)

`--loss` takes one name or a weighted sum, `0.5*kl+0.5*tv`; `parse_loss` reads it into {name: weight}. A
DFlash draft also takes `ce`, its own: cross-entropy on the data's next token at each block slot.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

LOSSES = ("kl", "rkl", "jsd", "tv", "nla", "lk")
BLOCK_LOSSES = ("ce", *LOSSES)  # a DFlash draft's: its own hard cross-entropy, and every soft one
OWN_LOSS = {"eagle3": "kl", "dflash": "ce"}  # what `--loss ""` (the default) trains each draft kind with
LK_ETA = 3.0  # lambda = exp(-LK_ETA * alpha)


def parse_loss(spec: str, names: tuple[str, ...] = LOSSES) -> dict[str, float]:
    """'kl', 'lk', '0.5*kl+0.5*tv', '2*jsd' -> {name: weight}, each name one of `names`; raises ValueError
    naming what is wrong."""
    terms: dict[str, float] = {}
    for part in spec.replace(" ", "").split("+"):
        w, star, name = part.rpartition("*")
        try:
            weight = float(w) if star else 1.0
        except ValueError:
            raise ValueError(f"--loss {spec!r}: {w!r} is not a number (write e.g. 0.5*kl+0.5*tv)") from None
        if name not in names:
            raise ValueError(f"--loss {spec!r}: unknown loss {name!r}; one of {', '.join(names)}, or a weighted "
                             "sum such as 0.5*kl+0.5*tv")  # fmt: skip
        if weight <= 0:
            raise ValueError(f"--loss {spec!r}: the weight of {name} must be positive, not {weight}")
        terms[name] = terms.get(name, 0.0) + weight
    return terms


def _xlogx(x: torch.Tensor) -> torch.Tensor:
    return torch.special.xlogy(x, x)  # 0 where x = 0


def divergence(terms: dict[str, float], logits: torch.Tensor, p: torch.Tensor, negent: torch.Tensor) -> tuple:
    """The weighted sum of `terms` per position, and KL(p || q) per position (detached unless a term).

    logits (M, Vd) the draft's, p (M, Vd) the teacher's probabilities, negent (M,) sum p log p -> (M,), (M,).
    """
    if set(terms) == {"kl"}:  # today's path, as fused as before
        kl = F.cross_entropy(logits, p, reduction="none") + negent  # (M,): - sum p log q + sum p log p
        return terms["kl"] * kl, kl.detach()
    # the KL outside the graph where no term takes it (a metric), and q without log q where no term reads log q:
    # 1.4x the speed of TV or NLA's pass here (a forward and backward over (M, Vd) fp32 saved)
    with contextlib.nullcontext() if set(terms) & {"kl", "lk"} else torch.no_grad():
        kl = F.cross_entropy(logits, p, reduction="none") + negent  # (M,)
    logq = F.log_softmax(logits, dim=-1) if set(terms) & {"rkl", "jsd"} else None  # (M, Vd)
    q = F.softmax(logits, dim=-1) if logq is None else logq.exp()  # (M, Vd)
    alpha = torch.minimum(p, q).sum(-1)  # (M,): acceptance rate
    tv = 1.0 - alpha  # (M,): equals sum |p - q| / 2 for two distributions
    out = torch.zeros_like(kl)
    for name, w in terms.items():
        if name == "kl":
            v = kl
        elif name == "rkl":  # sum q log q - sum q log p; p floored where it underflowed to 0
            v = (q * logq).sum(-1) - (q * p.clamp_min(torch.finfo(p.dtype).tiny).log()).sum(-1)
        elif name == "jsd":
            m = 0.5 * (p + q)  # (M, Vd)
            logm = m.clamp_min(torch.finfo(m.dtype).tiny).log()
            v = 0.5 * (negent - (p * logm).sum(-1)) + 0.5 * ((q * logq).sum(-1) - (q * logm).sum(-1))
        elif name == "tv":
            v = tv
        elif name == "nla":
            v = -alpha.clamp_min(torch.finfo(alpha.dtype).tiny).log()
        else:  # lk: the adaptive KL/TV blend, its weight detached
            lam = torch.exp(-LK_ETA * alpha.detach())
            v = lam * kl + (1.0 - lam) * tv
        out = out + w * v
    return out, kl.detach()


def acceptance(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """alpha = sum min(p, q) per position (M,), detached: speculative sampling's acceptance rate."""
    with torch.no_grad():
        return torch.minimum(p, F.softmax(logits.float(), dim=-1)).sum(-1)
