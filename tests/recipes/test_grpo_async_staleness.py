"""grpo_async leaves staleness to the server: its requests carry max_weight_staleness, and a group
with a sample the server ended as "stale" is dropped whole (GRPO's advantages need every sample
of a group). Fast: a stand-in client answers as the server does; tests/recipes/test_recipes.py
runs the recipe against a real server."""
import random
from types import SimpleNamespace

from recipes import grpo_arithmetic, grpo_async
from rollout.client import GenerateOutput


class AnswersAsTheServer:
    """generate(): n samples per prompt, the ones in `stale` (prompt index, sample index) ended
    early by the server with finish_reason "stale" (old-version tokens only)."""

    def __init__(self, stale: set[tuple[int, int]]):
        self.stale, self.sent = stale, []

    def tokenize(self, messages):
        return [1, 2, 3]

    def generate(self, prompts, params):
        self.sent.append(params)
        return [[GenerateOutput(token_ids=[7, 8] if (p, i) in self.stale else [7, 8, 9], logprobs=[-1.0] * 3,
                                weight_versions=[4, 4] if (p, i) in self.stale else [4, 4, 5],
                                text="Answer: 1", finish_reason="stale" if (p, i) in self.stale else "length")
                 for i in range(params["n"])] for p in range(len(prompts))]


def test_stale_samples_drop_their_groups_and_the_limit_goes_to_the_server():
    args = grpo_async.parse_args(["--prompts", "3", "--group", "2", "--max-staleness", "1"])
    client = AnswersAsTheServer(stale={(0, 1), (2, 0), (2, 1)})
    batch = grpo_arithmetic.rollout_batch(client, random.Random(0), args, seed=1,
                                          extra_params={"max_weight_staleness": args.max_staleness})
    assert client.sent[0]["max_weight_staleness"] == 1 and client.sent[0]["n"] == 2
    assert batch["stale"] == 3 and batch["stale_groups"] == 2
    assert len(batch["seqs"]) == 2 and batch["lengths"] == [3, 3]  # prompt 1's group, whole
    assert batch["versions"] == [4, 4, 5, 4, 4, 5]
    assert grpo_async.within_request_spread(batch) == 1
    none_left = grpo_arithmetic.rollout_batch(AnswersAsTheServer({(0, 0)}), random.Random(0),
                                              SimpleNamespace(prompts=1, group=2, max_tokens=4), seed=1)
    assert none_left["seqs"] == [] and none_left["stale_groups"] == 1  # (the recipe skips such a batch)
