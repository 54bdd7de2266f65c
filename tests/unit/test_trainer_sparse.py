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
