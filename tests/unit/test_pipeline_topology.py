"""Where a pipelined model's parts run and which channels join them (kvstore.pipeline.topology), and the
layer roles read without building anything (kvstore.pipeline.layers.Roles)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvstore.errors import ConfigError  # noqa: E402
from kvstore.net.protocol import Op  # noqa: E402
from kvstore.pipeline.layers import LayerSpec, Roles, Save, Take, Tied, build, run  # noqa: E402
from kvstore.pipeline.topology import Topology  # noqa: E402

ACT, GRAD = Op.PIPE_ACT, Op.PIPE_GRAD


def model() -> list:
    lin = LayerSpec(torch.nn.Linear, 3, 3)
    return [Tied("t", lin), Save("a"), lin, Save("b"), lin, Take("b"), lin, Take("a"), Tied("t", lin)]


def test_roles_read_skips_and_tied_places_without_building() -> None:
    """Roles finds each skip's keeping and using layer and each tied key's places; a tied place is
    seeded as its first place."""
    roles = Roles(model())
    assert roles.saves == {"a": 1, "b": 3} and roles.takes == {"b": 5, "a": 7}
    assert roles.tied == {0: "t", 8: "t"} and roles.seed_index(8) == 0 and roles.seed_index(4) == 4


@pytest.mark.parametrize("bad,words", [
    ([Save("a"), Save("a"), Take("a")], "kept twice"),
    ([Take("a"), Save("a")], "before any layer keeps it"),
    ([Save("a"), LayerSpec(torch.nn.Tanh)], "never used"),
])
def test_bad_skips_are_config_errors(bad, words) -> None:
    """A skip kept twice, used before it is kept, or never used is refused by name."""
    with pytest.raises(ConfigError, match=words):
        Roles(bad)


def test_one_process_model_shares_the_tied_module_and_runs_skips() -> None:
    """build() makes one module for both tied places; run() adds each kept skip where it is used."""
    net = build(model(), seed=1)
    assert net[0].module is net[8].module
    x = torch.randn(2, 3)
    h0 = net[0](x)
    h2 = net[2](h0)
    h4 = net[4](h2)
    expected = net[8](net[6](h4 + h2) + h0)
    torch.testing.assert_close(run(net, x, {}), expected)


def test_skip_routes_go_straight_to_the_part_that_uses_them() -> None:
    """4 stages x 2 replicas: skip 'a' (layer 1 -> 7) joins stage 0 to stage 3 directly, 'b' stays inside
    a stage; the tied key is held by stages 0 and 3."""
    top = Topology(4, 1, 2, [2, 4, 1, 2], Roles(model()))
    assert top.skips == {"a": (0, 3)}  # "b" is kept and used inside part 1
    assert top.skips_out(0) == ["a"] and top.skips_in(3) == ["a"]
    routes = top.routes(stage=0, replica=1)  # worker 4
    assert routes == {(GRAD, 0, ""): 5, (GRAD, 0, "a"): 7}
    assert top.routes(stage=3, replica=1) == {(ACT, 3, ""): 6, (ACT, 3, "a"): 4}
    assert top.peers(0, 1) == {5, 7}
    assert top.tied_stages() == {"t": [0, 3]}


def test_interleaved_parts_wrap_from_the_last_stage_to_the_first() -> None:
    """2 stages x 2 parts each: stage 0 runs parts 0 and 2, stage 1 parts 1 and 3; part 1 (stage 1)
    sends to part 2 (stage 0)."""
    lin = LayerSpec(torch.nn.Linear, 3, 3)
    top = Topology(2, 2, 1, [1, 1, 1, 1], Roles([lin] * 4))
    assert top.local_parts(0) == [0, 2] and top.local_parts(1) == [1, 3]
    assert top.routes(0, 0) == {(GRAD, 0, ""): 1, (ACT, 2, ""): 1, (GRAD, 2, ""): 1}
    assert top.routes(1, 0) == {(ACT, 1, ""): 0, (GRAD, 1, ""): 0, (ACT, 3, ""): 0}


def test_a_balance_of_the_wrong_length_is_refused() -> None:
    """The balance needs one entry per part (stages x virtual)."""
    with pytest.raises(ConfigError, match="4 entries"):
        Topology(2, 2, 1, [2, 2], Roles([LayerSpec(torch.nn.Tanh)] * 4))
