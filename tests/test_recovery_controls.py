"""Recovery read so it can fail: the found circuit against random head sets of its size and its
unsupervised part, on the planted model whose deciding head is known."""

import pytest
from planted import DECIDER, GENERIC, GENERIC_GAIN, REGION_GAIN, planted_examples

from mistill_lens.distill.evaluation import recovery_controls
from mistill_lens.lens.results import CharacterizeConfig


def test_the_deciding_head_beats_random_sets_and_its_supervised_part_is_set_apart(planted):
    bridge, tokenizer = planted
    examples, reference = planted_examples(12, 0), planted_examples(24, 1)
    config = CharacterizeConfig(seed=0, progress=False)
    found = recovery_controls(
        bridge, tokenizer, examples, reference, [DECIDER], [], config, kind="region", n_random=19
    )["recovery_controls"]
    # the decider carries REGION_GAIN / (REGION_GAIN + GENERIC_GAIN) of the margin where only the
    # two heads write to it (the rest of the region events share a little with the within head)
    assert found["found"] == pytest.approx(REGION_GAIN / (REGION_GAIN + GENERIC_GAIN), abs=0.05)
    assert found["random_mean"] < 0.5 * found["found"]
    # of 8 heads a random one is the decider 1 time in 8: few random sets reach its recovery
    assert found["p_found_vs_random"] < 0.5
    assert found["unsupervised"] == pytest.approx(found["found"])  # nothing was supervised
    supervised = recovery_controls(
        bridge, tokenizer, examples, reference, [DECIDER, GENERIC], [DECIDER], config, "region", 5
    )["recovery_controls"]
    assert supervised["unsupervised_heads"] == [list(GENERIC)]
    assert supervised["unsupervised"] == pytest.approx(
        GENERIC_GAIN / (REGION_GAIN + GENERIC_GAIN), abs=0.05
    )
    empty = recovery_controls(bridge, tokenizer, examples, reference, [], [], config, "region")
    assert empty == {"recovery_controls": None}
