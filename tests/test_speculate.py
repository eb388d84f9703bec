"""Reference speculative decoding: acceptance rules against analytic rates, tau of agreeing / disagreeing
drafts (stub bigram models with fixed logits), the output distribution of sampled decoding, the tree mask
in the target's verify pass, and losslessness (T = 0) on a tiny random Llama and on the embedded default."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import build_tiny_model

from specdraft.decode.rules import accept_chain, accept_tree, draft_probs_full
from specdraft.decode.runners import EagleDrafter, HFTargetRunner
from specdraft.decode.speculate import (
    SpecConfig,
    Speculator,
    make_generator,
    speculative_generate,
    target_generate,
)
from specdraft.decode.tree import DraftTree, ancestor_mask, draft_tree
from specdraft.model.draft import build_draft
from specdraft.targets import wrap_model

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------------------
# stubs: bigram "models" whose next-token logits depend only on the current token
# ---------------------------------------------------------------------------------------------------------


class BigramTarget:
    """A TargetRunner whose logits at a token are table[token] (V, V); aux features are the token id."""

    def __init__(self, table: torch.Tensor):
        self.table = table.float()
        self.cache: list[int] = []

    def reset(self) -> None:
        self.cache = []

    def __len__(self) -> int:
        return len(self.cache)

    def forward(self, ids, positions, tree_mask=None, last_only=False):
        assert positions.tolist() == [len(self.cache) + i for i in range(len(ids))] or tree_mask is not None
        self.cache += ids.tolist()
        logits = self.table[ids]  # (T, V)
        return (logits[-1:] if last_only else logits), ids[:, None].float()  # (T, V), (T, 1)

    def keep(self, n_past, index):
        self.cache = self.cache[:n_past] + [self.cache[n_past + i] for i in index.tolist()]


class BigramDrafter:
    """A Drafter over a draft vocabulary `target_ids` (Vd,) with logits table[token] (V, Vd)."""

    def __init__(self, table: torch.Tensor, target_ids: torch.Tensor):
        self.table = table.float()
        self.target_ids = target_ids
        self.n = 0

    def reset(self) -> None:
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def crop(self, n: int) -> None:
        assert n <= self.n
        self.n = n

    def extend(self, aux, ids, positions):
        assert positions.tolist() == list(range(self.n, self.n + len(ids)))
        self.n += len(ids)
        return torch.zeros(1), self.table[ids[-1]]  # (1,), (Vd,)

    def step(self, ids, hidden, positions, mask):
        assert mask is None or mask.shape == (len(ids), self.n + len(ids))
        self.n += len(ids)
        return torch.zeros(len(ids), 1), self.table[ids]  # (K, 1), (K, Vd)


def peaked_table(V: int, seed: int, scale: float = 6.0) -> torch.Tensor:
    """Random bigram logits (V, V) with a clear argmax per row."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, V, generator=g) + scale * F_one_hot(torch.randperm(V, generator=g), V)


def F_one_hot(idx: torch.Tensor, V: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(idx, V).float()


def chi2_critical(df: int, z: float = 3.72) -> float:
    """Upper quantile of chi-square(df) at the normal quantile z (Wilson-Hilferty; z = 3.72 is p = 1e-4)."""
    a = 2.0 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


# ---------------------------------------------------------------------------------------------------------
# tau of agreeing / disagreeing drafts
# ---------------------------------------------------------------------------------------------------------

V = 12


@pytest.mark.parametrize("k", [1, 3, 5])
def test_agreeing_chain_gives_k_plus_1(k):
    table = peaked_table(V, 0)
    cfg = SpecConfig(k=k, max_new_tokens=40)
    r = speculative_generate(BigramTarget(table), BigramDrafter(table, torch.arange(V)), [3], cfg)
    base = target_generate(BigramTarget(table), [3], 40)
    assert r.tokens == base.tokens
    assert r.accepted == [k] * len(r.accepted) and r.tau == k + 1
    assert r.target_forwards == 1 + math.ceil((40 - 1) / (k + 1))


def test_disagreeing_chain_gives_1():
    table = peaked_table(V, 0)
    wrong = table.clone()
    wrong[torch.arange(V), table.argmax(-1)] = -100.0  # the draft's argmax is never the target's
    cfg = SpecConfig(k=4, max_new_tokens=20)
    r = speculative_generate(BigramTarget(table), BigramDrafter(wrong, torch.arange(V)), [3], cfg)
    assert r.tokens == target_generate(BigramTarget(table), [3], 20).tokens
    assert r.tau == 1.0 and set(r.accepted) == {0} and r.target_forwards == 20


@pytest.mark.parametrize("topk,depth,budget", [(1, 4, 4), (3, 4, 12), (4, 5, 30), (2, 6, 3)])
def test_agreeing_tree_accepts_its_best_path(topk, depth, budget):
    table = peaked_table(V, 1, scale=9.0)  # the argmax chain is the tree's best path
    cfg = SpecConfig(tree=True, topk=topk, depth=depth, budget=budget, max_new_tokens=60)
    r = speculative_generate(BigramTarget(table), BigramDrafter(table, torch.arange(V)), [5], cfg)
    assert r.tokens == target_generate(BigramTarget(table), [5], 60).tokens
    best = min(depth, budget)  # deepest path the budget allows: the greedy chain is the best-scored path
    assert r.accepted == [best] * len(r.accepted) and r.tau == best + 1
    assert all(n == min(budget, topk + (depth - 1) * topk * topk) for n in r.drafted)


def test_disagreeing_tree_gives_1():
    table = peaked_table(V, 2)
    wrong = table.clone()
    wrong[torch.arange(V), table.argmax(-1)] = -100.0  # never in the draft's top-k (k < V)
    cfg = SpecConfig(tree=True, topk=3, depth=4, budget=10, max_new_tokens=15)
    r = speculative_generate(BigramTarget(table), BigramDrafter(wrong, torch.arange(V)), [0], cfg)
    assert r.tokens == target_generate(BigramTarget(table), [0], 15).tokens and r.tau == 1.0


def test_tree_selection_is_ancestor_closed_and_topologically_ordered():
    g = torch.Generator().manual_seed(0)
    table = torch.randn(30, 30, generator=g)
    d = BigramDrafter(table, torch.arange(30))
    d.extend(torch.zeros(4, 1), torch.tensor([1, 2, 3, 4]), torch.arange(4))
    cfg = SpecConfig(tree=True, topk=5, depth=4, budget=17)
    tree = draft_tree(d, torch.zeros(1), table[4], 4, 3, cfg.topk, cfg.depth, cfg.budget)
    assert len(tree) == 18 and tree.parents[0] == -1 and tree.depths[0] == 0
    for i in range(1, len(tree)):
        assert tree.parents[i] < i and tree.depths[i] == tree.depths[tree.parents[i]] + 1
    m = ancestor_mask(tree.parents)
    assert m.diagonal().all() and m[:, 0].all() and not m.triu(1).any()


# ---------------------------------------------------------------------------------------------------------
# sampling: analytic acceptance and exact output distribution
# ---------------------------------------------------------------------------------------------------------


def _dists(seed: int, Vt: int = 6, draft_ids=(0, 1, 2, 4)):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(Vt, generator=g) * 1.5, -1)  # (V,)
    ids = torch.tensor(draft_ids)
    q = draft_probs_full(
        torch.randn(len(ids), generator=g) * 1.5, ids, Vt, 1.0
    )  # (V,) zero off the draft vocab
    return p, q


def test_chain_acceptance_matches_analytic_rate():
    p, q = _dists(0)
    alpha = float(torch.minimum(p, q).sum())  # P(accept) = sum_x min(p(x), q(x))
    gen = make_generator(0)
    N = 20000
    hits = 0
    out = Counter()
    for _ in range(N):
        x = int(torch.multinomial(q, 1, generator=gen))
        a, nxt = accept_chain(p[None].expand(2, -1), [x], q[None], gen)
        hits += a
        out[x if a else nxt] += 1
    tol = 4.5 * math.sqrt(alpha * (1 - alpha) / N)  # 4.5 sigma of a binomial proportion
    assert abs(hits / N - alpha) < tol, (hits / N, alpha)
    # the emitted token (accepted draft or residual draw) is distributed as p
    chi2 = sum((out[x] - N * float(p[x])) ** 2 / (N * float(p[x])) for x in range(len(p)))
    assert chi2 < chi2_critical(len(p) - 1), chi2


def test_tree_acceptance_matches_analytic_rate():
    p, _ = _dists(1)
    kids = [2, 4]  # deterministic candidates: P(accept some child) = p(2) + p(4)
    alpha = float(p[kids].sum())
    gen = make_generator(1)
    N = 20000
    hits, out = 0, Counter()
    P = torch.stack([p, p, p])  # (3, V) root + two children
    for _ in range(N):
        path, nxt = accept_tree(P, [9, 2, 4], [[1, 2], [], []], greedy=False, generator=gen)
        hits += len(path) > 0
        out[[9, 2, 4][path[0]] if path else nxt] += 1
    assert abs(hits / N - alpha) < 4.5 * math.sqrt(alpha * (1 - alpha) / N)
    chi2 = sum((out[x] - N * float(p[x])) ** 2 / (N * float(p[x])) for x in range(len(p)))
    assert chi2 < chi2_critical(len(p) - 1), chi2


@pytest.mark.parametrize("tree", [False, True])
def test_sampled_decoding_keeps_the_target_distribution(tree):
    """The joint law of the first 3 new tokens of sampled speculative decoding equals the target's."""
    Vt = 4
    g = torch.Generator().manual_seed(3)
    t_table = torch.randn(Vt, Vt, generator=g) * 1.2
    d_ids = torch.tensor([0, 1, 3])  # token 2 is outside the draft vocabulary
    d_table = torch.randn(Vt, 3, generator=g) * 1.2
    temp = 0.8
    cfg = SpecConfig(k=2, tree=tree, topk=2, depth=2, budget=3, temperature=temp, max_new_tokens=3)
    P = torch.softmax(t_table / temp, -1)  # (V, V) next-token law given the current token
    prompt = [1]
    exact = {}
    for a in range(Vt):
        for b in range(Vt):
            for c in range(Vt):
                exact[(a, b, c)] = float(P[prompt[-1], a] * P[a, b] * P[b, c])
    N = 6000
    gen = make_generator(7)
    tgt, dr = BigramTarget(t_table), BigramDrafter(d_table, d_ids)
    counts = Counter(tuple(speculative_generate(tgt, dr, prompt, cfg, gen).tokens) for _ in range(N))
    cells = [c for c in exact if exact[c] * N >= 5]  # chi-square needs expected counts >= 5; pool the rest
    rest_e = N * sum(exact[c] for c in exact if c not in cells)
    rest_o = sum(v for c, v in counts.items() if c not in cells)
    chi2 = sum((counts[c] - N * exact[c]) ** 2 / (N * exact[c]) for c in cells)
    chi2 += (rest_o - rest_e) ** 2 / rest_e if rest_e > 0 else 0.0
    assert chi2 < chi2_critical(len(cells)), (chi2, len(cells))
    tv = 0.5 * sum(abs(counts[c] / N - exact[c]) for c in exact)
    assert tv < 0.06, tv


# ---------------------------------------------------------------------------------------------------------
# a real transformers target: tree mask, and lossless greedy decoding
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return wrap_model(build_tiny_model("llama"), "tiny-llama")


class OracleDrafter:
    """A Drafter proposing the target's own greedy continuation (+ seeded logit noise), computed through a
    second KV cache over the same model: slot 0 holds x_0, slot 1 + t the token of draft slot t (x_{t+1})."""

    def __init__(self, target, x0: int, noise: float = 0.0, seed: int = 0):
        self.runner = HFTargetRunner(target, [])
        self.target_ids = torch.arange(target.vocab_size)
        self.x0, self.noise = x0, noise
        self.gen = torch.Generator().manual_seed(seed)

    def _noisy(self, logits):
        if self.noise:
            logits = logits + self.noise * torch.randn(logits.shape, generator=self.gen)
        return 1e5 * logits  # peaked (a random tiny model is flat): the greedy chain is the best-scored path

    def reset(self) -> None:
        self.runner.reset()
        self.runner.forward(torch.tensor([self.x0]), torch.tensor([0]), None, True)

    def __len__(self) -> int:
        return len(self.runner) - 1

    def crop(self, n: int) -> None:
        self.runner.keep(0, torch.arange(n + 1))

    def extend(self, aux, ids, positions):
        logits, _ = self.runner.forward(ids, positions + 1, None, False)
        return torch.zeros(1), self._noisy(logits[-1])

    def step(self, ids, hidden, positions, mask):
        K, S = len(ids), len(self)
        if mask is None:
            mask = torch.ones(K, S + K, dtype=torch.bool).tril(S)  # (K, S + K) causal
        full = torch.cat([torch.ones(K, 1, dtype=torch.bool), mask], dim=1)  # (K, 1 + S + K): x_0 first
        logits, _ = self.runner.forward(ids, positions + 1, full, False)
        return torch.zeros(K, 1), self._noisy(logits)


def _prompts(n: int, V: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, V, (int(torch.randint(3, 15, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def test_tree_mask_matches_each_branch_run_alone(tiny):
    """The verify pass over a tree (4D mask after a cached prefix) gives each node the logits and aux
    features of its root-to-node branch run as a plain causal sequence."""
    runner = HFTargetRunner(tiny, [2, 4, 5])
    prefix = [5, 17, 42, 8, 99]
    tree = DraftTree(
        tokens=[7, 11, 12, 13, 21, 22, 31], parents=[-1, 0, 0, 0, 1, 1, 4], depths=[0, 1, 1, 1, 2, 2, 3]
    )
    runner.reset()
    runner.forward(torch.tensor(prefix), torch.arange(5), None, True)
    logits, aux = runner.forward(torch.tensor(tree.tokens), 5 + torch.tensor(tree.depths), tree.mask(), False)
    for i in range(len(tree)):
        branch, j = [], i
        while j >= 0:
            branch.append(tree.tokens[j])
            j = tree.parents[j]
        seq = prefix + branch[::-1]
        runner.reset()
        ref_logits, ref_aux = runner.forward(torch.tensor(seq), torch.arange(len(seq)), None, False)
        torch.testing.assert_close(logits[i], ref_logits[-1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(aux[i], ref_aux[-1], atol=1e-4, rtol=1e-4)
    runner.close()


def test_cache_keep_selects_positions(tiny):
    runner = HFTargetRunner(tiny, [2, 4, 5])
    runner.reset()
    runner.forward(torch.tensor([1, 2, 3, 4, 5, 6]), torch.arange(6), None, True)
    k0 = runner.cache.layers[0].keys.clone()
    runner.keep(2, torch.tensor([3, 1]))
    assert len(runner) == 4
    torch.testing.assert_close(runner.cache.layers[0].keys, k0[..., [0, 1, 5, 3], :])
    runner.close()


@pytest.mark.parametrize("noise", [0.0, 0.05])
@pytest.mark.parametrize("tree", [False, True])
def test_lossless_greedy_with_an_oracle_draft_on_tiny_llama(tiny, tree, noise):
    """Real HF caches with many accepted tokens (an oracle draft, exact or noisy): output == target-only."""
    cfg = SpecConfig(k=3, tree=tree, topk=3, depth=4, budget=10, max_new_tokens=24)
    runner = HFTargetRunner(tiny, [2, 4, 5])
    taus = []
    for i, prompt in enumerate(_prompts(4, tiny.vocab_size, seed=1)):
        drafter = OracleDrafter(tiny, prompt[0], noise=noise, seed=i)
        base = target_generate(runner, prompt, cfg.max_new_tokens)
        spec = speculative_generate(runner, drafter, prompt, cfg)
        assert spec.tokens == base.tokens, (i, spec.tokens, base.tokens)
        assert spec.target_forwards == 1 + len(spec.accepted)
        taus.append(spec.tau)
        drafter.runner.close()
    runner.close()
    if noise == 0:
        best = cfg.max_draft_depth + 1
        assert all(t == best for t in taus), taus  # the oracle always agrees: tau = k + 1 / depth + 1
    else:
        assert 1.0 < float(np.mean(taus)) < cfg.max_draft_depth + 1, taus


class SteeredEagleDrafter(EagleDrafter):
    """The real `EagleDrafter` (draft forwards, its KV cache, crops and hidden-state feedback all run) whose
    logits are replaced by an `OracleDrafter`'s, read at the draft vocabulary's target ids: an untrained
    Eagle3Draft whose proposals the target accepts, wherever the target's choice is in the draft vocabulary."""

    def __init__(self, draft, oracle: OracleDrafter):
        super().__init__(draft)
        self.oracle = oracle

    def reset(self) -> None:
        super().reset()
        self.oracle.reset()

    def crop(self, n: int) -> None:
        super().crop(n)
        self.oracle.crop(n)

    def extend(self, aux, ids, positions):
        hidden, _ = super().extend(aux, ids, positions)
        _, logits = self.oracle.extend(aux, ids, positions)
        assert len(self) == len(self.oracle)
        return hidden, logits[self.target_ids]  # (H,), (Vd,)

    def step(self, ids, hidden, positions, mask):
        out, _ = super().step(ids, hidden, positions, mask)
        _, logits = self.oracle.step(ids, hidden, positions, mask)
        assert len(self) == len(self.oracle)
        return out, logits[:, self.target_ids]  # (K, H), (K, Vd)


@pytest.mark.parametrize("tree", [False, True])
def test_lossless_greedy_with_a_steered_eagle3_draft(tiny, tree):
    """An Eagle3Draft through `Speculator` with proposals the target accepts (some, not all): the output is
    target-only greedy decoding token for token, and tokens were accepted (tau > 1)."""
    cfg = SpecConfig(k=4, tree=tree, topk=4, depth=3, budget=12, max_new_tokens=20)
    prompts = _prompts(3, tiny.vocab_size, seed=2)
    runner = HFTargetRunner(tiny, [])
    bases = [target_generate(runner, p, cfg.max_new_tokens).tokens for p in prompts]
    runner.close()
    # a draft vocabulary of 128 of the 320 ids that holds every token greedy decoding emits (d2t is not trivial)
    counts = np.zeros(tiny.vocab_size, dtype=np.int64)
    np.add.at(counts, [t for b in bases for t in b], 1)
    draft = build_draft(tiny, counts, [2, 4, 5], draft_vocab_size=128)
    assert int(draft.d2t.abs().sum()) > 0
    sp = Speculator(tiny, draft)
    taus = []
    for i, (prompt, base) in enumerate(zip(prompts, bases)):
        assert sp.baseline(prompt, cfg, seed=i).tokens == base
        oracle = OracleDrafter(tiny, prompt[0], noise=0.05, seed=i)
        sp.drafter = SteeredEagleDrafter(draft, oracle)
        s = sp.generate(prompt, cfg, seed=i)
        oracle.runner.close()
        assert s.tokens == base and len(s.tokens) == 20, (i, s.tokens, base)
        assert s.target_forwards == 1 + len(s.accepted)
        taus.append(s.tau)
    sp.close()
    assert all(t > 1.0 for t in taus), taus  # acceptance happened in every generation
    assert float(np.mean(taus)) < cfg.max_draft_depth + 1, taus  # and rejection too (noisy proposals)


def test_sampled_speculation_is_seeded(tiny):
    counts = np.ones(tiny.vocab_size)
    sp = Speculator(tiny, build_draft(tiny, counts, [2, 4, 5], draft_vocab_size=64))
    cfg = SpecConfig(k=3, temperature=0.9, max_new_tokens=12)
    a, b = sp.generate([1, 2, 3], cfg, seed=5), sp.generate([1, 2, 3], cfg, seed=5)
    assert a.tokens == b.tokens and a.accepted == b.accepted
    sp.close()


def test_user_errors_are_explained(tiny):
    with pytest.raises(ValueError, match="k must be"):
        SpecConfig(k=0)
    with pytest.raises(ValueError, match="temperature"):
        SpecConfig(temperature=-1)
    other = wrap_model(build_tiny_model("qwen2"), "tiny-qwen")
    draft = build_draft(tiny, np.ones(tiny.vocab_size), [2, 4, 5], draft_vocab_size=64)
    draft.cfg.target_config_hash = tiny.config_hash
    with pytest.raises(ValueError, match="--target"):
        Speculator(other, draft)


# ---------------------------------------------------------------------------------------------------------
# the embedded default
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.real
def test_lossless_on_the_embedded_default(real_target):
    """Greedy speculative == target-only on a few MT-bench first turns (chain and tree), with an untrained
    Eagle3Draft steered to proposals the target accepts: tokens are accepted (tau > 1) and nothing changes."""
    from specdraft.eval.prompts import load_prompts, render_prompt

    tok = real_target.tokenizer
    prompts = [render_prompt(tok, [pr.turns[0]], []) for pr in load_prompts("mtbench", max_prompts=3)]
    runner = HFTargetRunner(real_target, [])
    bases = [target_generate(runner, ids, 16).tokens for ids in prompts]
    runner.close()
    counts = np.zeros(real_target.vocab_size, dtype=np.int64)
    np.add.at(counts, [t for b in bases for t in b], 1)  # the emitted tokens are in the draft vocabulary
    aux = [2, real_target.num_layers // 2, real_target.num_layers - 3]
    draft = build_draft(real_target, counts, aux, draft_vocab_size=8192)
    sp = Speculator(real_target, draft)
    for tree in (False, True):
        cfg = SpecConfig(k=4, tree=tree, topk=4, depth=4, budget=12, max_new_tokens=16)
        for i, (ids, base) in enumerate(zip(prompts, bases)):
            oracle = OracleDrafter(real_target, ids[0], noise=0.05, seed=i)
            sp.drafter = SteeredEagleDrafter(draft, oracle)
            s = sp.generate(ids, cfg)
            oracle.runner.close()
            assert s.tokens == base, (tree, i)
            assert s.tau > 1.0, (tree, i, s.accepted)
    sp.close()
