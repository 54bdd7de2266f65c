"""SparseTrainer and SparseEmbedding in a local store (docs/sparse.md): only the batch's rows are held and
updated, and training matches torch's own dense training step for step."""

from __future__ import annotations

import numpy as np
import pytest

import kvstore

torch = pytest.importorskip("torch")

ROWS, DIM, BATCH = 500, 4, 8


def _batches(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, ROWS, (BATCH, 3), generator=g), torch.randn(BATCH, 1, generator=g))
            for _ in range(4)]


def _reference(table: torch.Tensor, head: torch.nn.Linear, batches: list) -> tuple:
    """torch's own SGD over a full nn.Embedding and a copy of the head (loss summed / batch)."""
    emb = torch.nn.Embedding(ROWS, DIM, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(table)
    lin = torch.nn.Linear(DIM, 1)
    lin.load_state_dict(head.state_dict())
    opt = torch.optim.SGD([emb.weight, *lin.parameters()], lr=0.5)
    for ids, y in batches:
        opt.zero_grad()
        loss = ((lin(emb(ids).sum(1)) - y) ** 2).sum() / BATCH
        loss.backward()
        opt.step()
    return emb.weight.detach(), lin


def test_sparse_embedding_trains_as_torch_does_and_holds_only_the_batch_rows() -> None:
    """A SparseEmbedding's table lives in the store; the worker holds only a batch's distinct rows;
    after 4 steps the table and the head equal torch's SGD on a full embedding."""
    torch.manual_seed(0)
    head = torch.nn.Linear(DIM, 1)
    start_head = torch.nn.Linear(DIM, 1)
    start_head.load_state_dict(head.state_dict())
    emb = kvstore.SparseEmbedding(ROWS, DIM, init={"type": "uniform", "seed": 5})
    trainer = kvstore.SparseTrainer(head.named_parameters(), "sgd", {"learning_rate": 0.5},
                                    embeddings=[emb], kvstore="local")
    kv = trainer.kvstore
    batches = _batches(1)
    for step, (ids, y) in enumerate(batches):
        trainer.prefetch(emb, ids)
        assert emb.weight.shape == (len(np.unique(ids.numpy())), DIM)  # never the whole table
        if step == 0:
            table = torch.from_numpy(kv.pull(emb.key).copy())
        loss = ((head(emb(ids).sum(1)) - y) ** 2).sum()
        loss.backward()
        trainer.step(BATCH)
        head.zero_grad()
    want_table, want_head = _reference(table, start_head, batches)
    torch.testing.assert_close(torch.from_numpy(kv.pull(emb.key)), want_table, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head.weight, want_head.weight, rtol=1e-5, atol=1e-6)


def test_nn_embedding_sparse_modules_push_their_rows_and_prefetch_writes_them() -> None:
    """An nn.Embedding(sparse=True) given to SparseTrainer pushes its sparse gradient; prefetch writes the
    updated rows into the module; a dense nn.Embedding is refused."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(ROWS, DIM, sparse=True)
    head = torch.nn.Linear(DIM, 1)
    start_table = emb.weight.detach().clone()
    start_head = torch.nn.Linear(DIM, 1)
    start_head.load_state_dict(head.state_dict())
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    trainer = kvstore.SparseTrainer(model.named_parameters(), "sgd", {"learning_rate": 0.5},
                                    embeddings=[emb], kvstore="local")
    batches = _batches(2)
    for ids, y in batches:
        trainer.prefetch(emb, ids)
        loss = ((head(emb(ids).sum(1)) - y) ** 2).sum()
        loss.backward()
        trainer.step(BATCH)
        head.zero_grad()
    want_table, _ = _reference(start_table, start_head, batches)
    every = torch.arange(ROWS)
    trainer.prefetch(emb, every)
    torch.testing.assert_close(emb.weight.detach(), want_table, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="sparse=True"):
        kvstore.SparseTrainer(head.parameters(), "sgd", embeddings=[torch.nn.Embedding(3, 2)])


def test_an_id_not_prefetched_is_a_clear_error() -> None:
    """Calling a SparseEmbedding on an id it has not prefetched raises KeyError naming prefetch."""
    emb = kvstore.SparseEmbedding(ROWS, DIM)
    trainer = kvstore.SparseTrainer(torch.nn.Linear(DIM, 1).parameters(), "sgd", embeddings=[emb],
                                    kvstore="local")
    trainer.prefetch(emb, torch.tensor([3, 4]))
    with pytest.raises(KeyError, match="prefetch"):
        emb(torch.tensor([5]))


def _embedding_steps(trainer: kvstore.SparseTrainer, emb: torch.nn.Embedding, batches: list) -> None:
    """Train ``emb`` alone on ``batches`` (loss: the batch's vectors' sum against y)."""
    for ids, y in batches:
        trainer.prefetch(emb, ids)
        loss = ((emb(ids).sum((1, 2)) - y[:, 0]) ** 2).sum()
        loss.backward()
        trainer.step(BATCH)


def test_embeddings_alone_train_and_their_states_are_saved_and_loaded(tmp_path) -> None:
    """A SparseTrainer without a dense parameter trains its embedding; save_states / load_states carry
    the momentum of its rows: 2 steps, save, 2 steps in a new trainer equal 4 steps in one."""
    torch.manual_seed(0)
    batches = _batches(3)
    start = torch.nn.Embedding(ROWS, DIM, sparse=True).weight.detach().clone()
    params = {"learning_rate": 0.1, "momentum": 0.9}

    def embedding(table: torch.Tensor) -> torch.nn.Embedding:
        emb = torch.nn.Embedding(ROWS, DIM, sparse=True)
        with torch.no_grad():
            emb.weight.copy_(table)
        return emb

    whole = embedding(start)
    trainer = kvstore.SparseTrainer(None, "sgd", params, embeddings=[whole], kvstore="local", key_prefix="e")
    _embedding_steps(trainer, whole, batches)
    trainer.prefetch(whole, torch.arange(ROWS))
    first = embedding(start)
    half = kvstore.SparseTrainer([], "sgd", params, embeddings=[first], kvstore="local", key_prefix="e")
    _embedding_steps(half, first, batches[:2])
    half.save_states(str(tmp_path / "states"))
    half.prefetch(first, torch.arange(ROWS))
    second = embedding(first.weight.detach())
    rest = kvstore.SparseTrainer(None, "sgd", params, embeddings=[second], kvstore="local", key_prefix="e")
    rest.load_states(str(tmp_path / "states"))
    _embedding_steps(rest, second, batches[2:])
    rest.prefetch(second, torch.arange(ROWS))
    assert not torch.equal(whole.weight, start)
    torch.testing.assert_close(second.weight.detach(), whole.weight.detach(), rtol=1e-5, atol=1e-6)


def test_two_trainers_over_one_embedding_are_refused() -> None:
    """A second SparseTrainer over an embedding another one updates raises ValueError naming it."""
    emb = kvstore.SparseEmbedding(ROWS, DIM, key="shared-table")
    first = kvstore.SparseTrainer(None, "sgd", embeddings=[emb], kvstore="local")
    with pytest.raises(ValueError, match="shared-table"):
        kvstore.SparseTrainer(None, "sgd", embeddings=[emb], kvstore="local")
    del first  # gone: the embedding may have another trainer
    kvstore.SparseTrainer(None, "sgd", embeddings=[emb], kvstore="local")


def _local_mode_run(update_on_kvstore: bool | None, name: str, params: dict, tmp_path=None) -> tuple:
    """3 steps of nn.Embedding(sparse=True) + a head in a local store; returns (table, head weight,
    trainer).  With ``tmp_path`` the trainer saves its states after 2 steps and a new one loads them."""
    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(ROWS, DIM, sparse=True), torch.nn.Linear(DIM, 1)
    model = torch.nn.ModuleDict({"emb": emb, "head": head})

    def make() -> kvstore.SparseTrainer:
        return kvstore.SparseTrainer(model.named_parameters(), name, params, embeddings=[emb],
                                     kvstore="local", update_on_kvstore=update_on_kvstore, key_prefix="m")
    trainer = make()
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        ids, y = torch.randint(0, 40, (BATCH, 2), generator=g), torch.randn(BATCH, 1, generator=g)
        trainer.prefetch(emb, ids)
        ((head(emb(ids).sum(1)) - y) ** 2).sum().backward()
        trainer.step(BATCH)
        head.zero_grad()
        if step == 1 and tmp_path is not None:
            trainer.save_states(str(tmp_path / "states"))
            del trainer
            trainer = make()
            trainer.load_states(str(tmp_path / "states"))
    trainer.prefetch(emb, torch.arange(ROWS))
    return emb.weight.detach().clone(), head.weight.detach().clone(), trainer


@pytest.mark.parametrize("name,params", [("sgd", {"learning_rate": 0.1, "momentum": 0.9}),
                                         ("adam", {"learning_rate": 0.01})])
def test_update_on_kvstore_false_steps_as_the_store_does_and_only_touched_rows_get_state(
        name, params, tmp_path) -> None:
    """update_on_kvstore=False runs the optimizer here: table and head equal the store-run trainer's
    (None keeps that default); rows never touched keep their weights and have zero state; states saved
    after 2 steps and loaded into a new trainer (rows' state included) give the same 3rd step."""
    table, weight, trainer = _local_mode_run(False, name, params)
    assert not trainer.update_on_kvstore
    want_table, want_weight, default = _local_mode_run(None, name, params)
    assert default.update_on_kvstore
    torch.testing.assert_close(table, want_table, rtol=0, atol=1e-6)
    torch.testing.assert_close(weight, want_weight, rtol=0, atol=1e-6)
    torch.manual_seed(0)
    start = torch.nn.Embedding(ROWS, DIM, sparse=True).weight.detach()
    assert torch.equal(table[40:], start[40:]) and not torch.equal(table[:40], start[:40])
    state = trainer.optimizer.states["m/embedding0"]
    assert all(not a[40:].any() and a[:40].any() for a in state.values())
    resumed, resumed_weight, _ = _local_mode_run(False, name, params, tmp_path)
    torch.testing.assert_close(resumed, table, rtol=0, atol=1e-6)
    torch.testing.assert_close(resumed_weight, weight, rtol=0, atol=1e-6)


def test_embeddings_alone_update_locally_and_save_their_states(tmp_path) -> None:
    """A SparseTrainer without dense parameters and update_on_kvstore=False trains its table as the
    store-run one does; save_states / load_states round-trip its rows' momentum."""
    batches = _batches(5)
    params = {"learning_rate": 0.1, "momentum": 0.9}
    tables = []
    for on_store in (True, False):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(ROWS, DIM, sparse=True)
        trainer = kvstore.SparseTrainer(None, "sgd", params, embeddings=[emb], kvstore="local",
                                        update_on_kvstore=on_store, key_prefix="alone")
        _embedding_steps(trainer, emb, batches)
        trainer.prefetch(emb, torch.arange(ROWS))
        tables.append(emb.weight.detach().clone())
    torch.testing.assert_close(tables[1], tables[0], rtol=0, atol=1e-6)
    trainer.save_states(str(tmp_path / "s"))
    mom = trainer.optimizer.states["alone/embedding0"]["mom"].copy()
    del trainer
    again = kvstore.SparseTrainer(None, "sgd", params, embeddings=[emb], kvstore="local",
                                  update_on_kvstore=False, key_prefix="alone")
    again.load_states(str(tmp_path / "s"))
    np.testing.assert_array_equal(again.optimizer.states["alone/embedding0"]["mom"], mom)


def test_update_on_kvstore_false_refuses_async_stores_and_store_held_tables() -> None:
    """update_on_kvstore=False is refused for a dist_async store (as Trainer refuses it) and for a
    SparseEmbedding, whose table only the store holds."""
    emb = torch.nn.Embedding(ROWS, DIM, sparse=True)
    with pytest.raises(ValueError, match="dist_async"):
        kvstore.SparseTrainer(None, "sgd", embeddings=[emb], kvstore="dist_async", update_on_kvstore=False)
    with pytest.raises(ValueError, match="update_on_kvstore=True"):
        kvstore.SparseTrainer(None, "sgd", embeddings=[kvstore.SparseEmbedding(ROWS, DIM)], kvstore="local",
                              update_on_kvstore=False)


def test_dynamic_sparse_embedding_trains_as_the_fixed_table_of_the_same_init() -> None:
    """A SparseEmbedding over a dynamic table (ids any int64) trains step for step as a fixed one of
    the same init on the same ids, holds only the batch's rows, and a fixed/dynamic mix-up is refused."""
    torch.manual_seed(0)
    heads = [torch.nn.Linear(DIM, 1) for _ in range(2)]
    heads[1].load_state_dict(heads[0].state_dict())
    init = {"type": "uniform", "seed": 5}
    fixed = kvstore.SparseEmbedding(ROWS, DIM, init=init)
    dynamic = kvstore.SparseEmbedding(None, DIM, init=init, dynamic={"capacity": 10_000})
    trainers = [kvstore.SparseTrainer(h.named_parameters(), "adam", {"learning_rate": 0.1},
                                      embeddings=[e], kvstore="local")
                for h, e in zip(heads, (fixed, dynamic))]
    for ids, y in _batches(3):
        for head, emb, trainer in zip(heads, (fixed, dynamic), trainers):
            trainer.prefetch(emb, ids)
            assert emb.weight.shape == (len(np.unique(ids.numpy())), DIM)
            loss = ((head(emb(ids).sum(1)) - y) ** 2).sum()
            loss.backward()
            trainer.step(BATCH)
            head.zero_grad()
    every = np.arange(ROWS)
    got = trainers[1].kvstore.row_sparse_pull(dynamic.key, row_ids=every)
    want = trainers[0].kvstore.row_sparse_pull(fixed.key, row_ids=every)
    np.testing.assert_allclose(got.rows, want.rows, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(heads[1].weight, heads[0].weight)
    big = np.array([-(2**62), 2**62 + 1], np.int64)  # ids far outside any fixed range
    trainers[1].prefetch(dynamic, torch.from_numpy(big))
    assert list(dynamic.ids) == sorted(big.tolist())
    with pytest.raises(ValueError, match="num_rows"):
        kvstore.SparseEmbedding(None, DIM)
    with pytest.raises(ValueError, match="num_rows"):
        kvstore.SparseEmbedding(ROWS, DIM, dynamic=True)
