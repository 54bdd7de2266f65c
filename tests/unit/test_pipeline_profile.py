"""Balance by measured cost (kvstore.pipeline.profile): each layer measured alone, one at a time; the cut."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

import kvstore  # noqa: E402
from kvstore.errors import ConfigError  # noqa: E402
from kvstore.pipeline import LayerSpec, Save, Take  # noqa: E402
from kvstore.pipeline import layers as L  # noqa: E402
from kvstore.pipeline import schedule as S  # noqa: E402
from kvstore.pipeline.profile import SLACK, agreed_costs, choose, layer_costs  # noqa: E402

pytestmark = pytest.mark.timeout(60)
F32 = 4  # bytes of a float32


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread inside the block (a timing on a shared, loaded machine varies less)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def test_a_layer_with_64_times_the_flops_is_measured_slower() -> None:
    """'time': Linear(512, 512), 64x the flops of Linear(64, 64) on as many rows, takes over 4x its time."""
    entries = [LayerSpec(torch.nn.Linear, 512, 512), LayerSpec(torch.nn.Linear, 512, 64),
               LayerSpec(torch.nn.Linear, 64, 64)]
    with one_thread():
        costs = layer_costs(entries, torch.randn(256, 512), "time", repeats=7)
    assert len(costs) == 3 and all(c > 0 for c in costs)
    assert costs[0] > 4 * costs[2], costs


def test_time_reads_the_timer_given_around_each_run() -> None:
    """'time' reads the timer given (e.g. time.thread_time) before and after each timed run, not around the
    warm-up: a clock that moves 1 s per read makes every layer cost 1 s; a timer not callable is refused."""
    reads: list[float] = []

    def clock() -> float:
        reads.append(float(len(reads)))
        return reads[-1]

    linear = LayerSpec(torch.nn.Linear, 4, 4)
    costs = layer_costs([linear, linear], torch.randn(2, 4), "time", repeats=3, warmup=1, timer=clock)
    assert costs == [1.0, 1.0]
    assert len(reads) == 2 * 2 * 3  # two layers, two reads for each of 3 timed runs
    with pytest.raises(ConfigError, match="timer"):
        layer_costs([linear], torch.randn(2, 4), "time", timer=3.0)


def test_memory_is_parameters_gradients_states_and_saved_activations() -> None:
    """'memory' of Linear(16, 8) then Tanh on a (4, 16) float32 sample, by hand: the Linear holds its 136
    parameters, their gradients and 2 optimizer states each, and saves its input; Tanh saves its output."""
    entries = [LayerSpec(torch.nn.Linear, 16, 8), LayerSpec(torch.nn.Tanh)]
    costs = layer_costs(entries, torch.randn(4, 16), "memory", optimizer_states=2)
    params = (16 * 8 + 8) * F32
    assert costs == [params * (1 + 1 + 2) + 4 * 16 * F32, 4 * 8 * F32]
    without = layer_costs(entries, torch.randn(4, 16), "memory", optimizer_states=0)
    assert without[0] == params * 2 + 4 * 16 * F32


def test_frozen_parameters_and_buffers_count_once() -> None:
    """A frozen parameter has no gradient or optimizer state (and a frozen first layer on the data saves
    nothing for a backward); a buffer (running statistics) counts once."""
    frozen = torch.nn.Linear(8, 8)
    frozen.requires_grad_(False)
    costs = layer_costs([frozen, torch.nn.BatchNorm1d(8)], torch.randn(4, 8), "memory", optimizer_states=1)
    assert costs[0] == (8 * 8 + 8) * F32
    norm = 2 * 8 * F32 * 3 + (2 * 8 * F32 + 8)  # weight and bias x (param, grad, state); running stats, count
    assert costs[1] > norm  # plus what batch norm saves for its backward


def test_skip_connections_carry_across_the_layers_measured() -> None:
    """Save/Take among the layers: the Take measured gets what the Save kept (x * saved saves both), in
    either mode, and every layer has a cost."""
    entries = [LayerSpec(torch.nn.Linear, 8, 8), Save("s"), LayerSpec(torch.nn.Linear, 8, 8),
               LayerSpec(Take, "s", torch.mul), LayerSpec(torch.nn.Linear, 8, 2)]
    sample = torch.randn(4, 8)
    memory = layer_costs(entries, sample, "memory", optimizer_states=0)
    assert memory[1] == 0  # Save: the identity
    assert memory[3] == 2 * 4 * 8 * F32  # mul saves both of its operands: the skip arrived
    times = layer_costs(entries, sample, "time", repeats=2)
    assert len(times) == 5 and all(t > 0 for t in times)


def test_a_tuple_between_layers_is_measured_per_tensor() -> None:
    """A layer may return a tuple, which the next takes as its one argument; each float element's backward
    runs, and a saved tensor of each counts."""

    class Split(torch.nn.Module):
        def forward(self, x):
            return x * 2, x.tanh()

    class Join(torch.nn.Module):
        def forward(self, pair):
            return pair[0] * pair[1]

    sample = torch.randn(3, 5, requires_grad=True)  # the first layer's input as given: here it wants grad
    costs = layer_costs([Split(), Join()], sample, "memory", optimizer_states=0)
    assert costs == [3 * 5 * F32, 2 * 3 * 5 * F32]  # tanh saves its output; mul both operands
    assert len(layer_costs([Split(), Join()], torch.randn(3, 5), "time", repeats=1)) == 2


def test_a_built_module_is_measured_in_place_and_left_unchanged() -> None:
    """A built nn.Sequential is measured as it is: not moved or released, its weights, buffers (batch norm's
    running statistics) and .grad untouched, and the caller's random generator where it was."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5),
                                torch.nn.Linear(8, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ptrs = [p.data_ptr() for p in model.parameters()]
    sample = torch.randn(6, 8)
    rng = torch.get_rng_state()
    for mode in ("time", "memory"):
        assert len(layer_costs(model, sample, mode, repeats=2)) == 4
    after = model.state_dict()
    assert sorted(after) == sorted(before)
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    assert all(p.grad is None and not p.is_meta for p in model.parameters())
    assert not any(getattr(layer, L.RELEASED, False) for layer in model)
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_device_runs_the_sample_and_layers_there_and_leaves_a_built_module_where_it_is() -> None:
    """``device=``: the sample and each layer run there; a built module already there is measured in place
    (the same costs as without a device), one elsewhere on a copy (the meta device stands in for a GPU
    here), so the caller's module stays on the CPU, unchanged; an unknown device is a ConfigError."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sample = torch.randn(4, 8)
    expected = layer_costs(model, sample, "memory")
    assert layer_costs(model, sample, "memory", device="cpu") == expected
    assert layer_costs([LayerSpec(torch.nn.Linear, 8, 8)], sample, "memory", device=torch.device("cpu")) == [
        expected[0]]
    elsewhere = layer_costs(model, sample, "time", repeats=1, device="meta")
    assert len(elsewhere) == 3
    assert all(p.device.type == "cpu" and p.grad is None for p in model.parameters())
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    with pytest.raises(ConfigError, match="'gpu9' is not a torch device"):
        layer_costs(model, sample, "time", device="gpu9")


def test_factories_and_meta_layers_are_built_one_at_a_time_and_left_as_they_were() -> None:
    """Factories are called one at a time (each layer dropped before the next is built); a meta model stays
    on meta, so a Pipeline can still materialise it under its seeds."""
    alive: list[int] = []
    most = [0]

    class Counted(torch.nn.Linear):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            if not self.weight.is_meta:
                alive.append(1)
                most[0] = max(most[0], len(alive))

        def __del__(self) -> None:
            if alive:
                alive.pop()

    built = layer_costs([LayerSpec(Counted, 8, 8) for _ in range(4)], torch.randn(2, 8), "memory")
    assert len(built) == 4 and most[0] == 1
    with torch.device("meta"):
        meta = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    costs = layer_costs(meta, torch.randn(2, 8), "memory", optimizer_states=0)
    assert costs[0] == (8 * 8 + 8) * F32 * 2 + 2 * 8 * F32
    assert all(p.is_meta for p in meta.parameters())
    assert not any(getattr(layer, L.RELEASED, False) for layer in meta)
    reference = L.build(meta, seed=3)  # still materialisable under the seeds
    assert not any(p.is_meta for p in reference.parameters())


def test_unknown_mode_missing_sample_and_bad_counts_are_config_errors() -> None:
    """An unknown mode, no sample, or a count below its least are ConfigErrors naming the fix."""
    entries = [LayerSpec(torch.nn.Linear, 4, 4)]
    with pytest.raises(ConfigError, match="'speed' is not one of 'time', 'memory'"):
        layer_costs(entries, torch.randn(2, 4), "speed")
    with pytest.raises(ConfigError, match="sample="):
        layer_costs(entries, None, "time")
    with pytest.raises(ConfigError, match="repeats must be an int >= 1"):
        layer_costs(entries, torch.randn(2, 4), "time", repeats=0)
    with pytest.raises(ConfigError, match="optimizer_states"):
        layer_costs(entries, torch.randn(2, 4), "memory", optimizer_states=-1)


def test_costs_one_to_eight_cut_where_the_time_is_even() -> None:
    """Four layers costing 8 then 32 costing 1 cut into 2 and 4 even stages by cost (floats, with noise),
    where their parameter counts (1:8 the other way) would load the first stage with most of the work."""
    noise = [1 + 0.01 * ((7 * i) % 5 - 2) for i in range(36)]
    costs = [c * n for c, n in zip([8.0] * 4 + [1.0] * 32, noise)]
    assert S.balance_by_weight(costs, 2) == S.balance_by_weight(costs, 2, slack=SLACK) == [4, 32]
    assert S.balance_by_weight(costs, 4, slack=SLACK) == [2, 2, 16, 16]
    by_params = S.balance_by_weight([1] * 4 + [8] * 32, 2)
    assert by_params == [20, 16]
    first = sum(costs[:by_params[0]])
    assert first / sum(costs[by_params[0]:]) > 2


def test_slack_keeps_the_heaviest_stage_near_least_and_lifts_the_lightest() -> None:
    """With ``slack=0``, of the cuts whose heaviest stage is lightest, the one whose lightest is heaviest
    (the first found may leave a stage nearly empty); with 5%, a heaviest stage up to 5% heavier for a
    more even cut (noise in measured costs must not buy a 1% lighter heaviest stage with a far lighter
    lightest); without a slack the cut is as before; a negative slack is a ConfigError."""
    weights = [1] * 6 + [5, 5]
    assert S.balance_by_weight(weights, 4) == [1, 5, 1, 1]  # heaviest 5, lightest 1
    assert S.balance_by_weight(weights, 4, slack=0) == [3, 3, 1, 1]  # heaviest 5, lightest 3
    costs = [2.5, 0.1, 0.1, 2.4, 0.2, 2.6]
    for stages in (1, 2, 3, 6):
        plain, even = S.balance_by_weight(costs, stages), S.balance_by_weight(costs, stages, slack=0.0)
        assert max(S._runs(costs, even)) == max(S._runs(costs, plain))
        assert min(S._runs(costs, even)) >= min(S._runs(costs, plain))
    assert S.balance_by_weight([0, 0, 0], 3, slack=0) == [1, 1, 1]
    noisy = [1.0] * 64 + [10.0] * 4 + [9.8] * 4  # 4 of the costly layers: 40, or 39.2
    assert S.balance_by_weight(noisy, 4, slack=0) == [35, 30, 3, 4]  # 35 / 39 / 30 / 39.2: 1.31
    assert S.balance_by_weight(noisy, 4, slack=0.05) == [32, 32, 4, 4]  # 32 / 32 / 40 / 39.2: 1.25
    with pytest.raises(ConfigError, match="slack"):
        S.balance_by_weight(noisy, 4, slack=-0.1)


def test_choose_each_balance() -> None:
    """None and 'parameters' cut by parameter count; 'memory' by costs shared through a store (here the
    local one, rank 0); a list is checked; anything else is a ConfigError."""
    entries = [LayerSpec(torch.nn.Linear, 32, 32), LayerSpec(torch.nn.Linear, 32, 4),
               LayerSpec(torch.nn.Tanh), LayerSpec(torch.nn.Linear, 4, 4)]
    assert choose(None, entries, 2, None, None) == choose("parameters", entries, 2, None, None) == [1, 3]
    assert choose([2, 2], entries, 2, None, None) == [2, 2]
    with pytest.raises(ConfigError):
        choose([3, 2], entries, 2, None, None)
    with pytest.raises(ConfigError, match="pass kv="):
        choose("time", entries, 2, None, torch.randn(2, 32))
    with pytest.raises(ConfigError, match="'fastest'"):
        choose("fastest", entries, 2, None, None)
    kv = kvstore.create("local")
    try:
        with pytest.raises(ConfigError, match="4 layers into 5 stages"):  # before anything is measured
            choose("time", entries, 5, kv, None)
        sample = torch.randn(64, 32)  # saved activations outweigh the first Linear's parameters
        costs = agreed_costs(kv, entries, sample, "memory", optimizer_states=0)
        assert costs == layer_costs(entries, sample, "memory", optimizer_states=0)
        cut = S.balance_by_weight(costs, 2, slack=SLACK)
        assert choose("memory", entries, 2, kv, sample, optimizer_states=0) == cut
        assert len(choose("time", entries, 3, kv, sample, repeats=1)) == 3
    finally:
        kv.close()
