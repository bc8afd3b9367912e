"""knnconv.neighbours: the native tables cache of the pooling and depthwise layers."""

import copy
import pickle

import torch

from knnconv.neighbours import NativeTableCache

NIN = 5


def _tables_over(storage: torch.UntypedStorage, values: list[list[int]]) -> torch.Tensor:
    """An int64 [K, Nout] tensor over ``storage`` (so two of them share one address), written
    in place once (version 1)."""
    table = torch.empty(0, dtype=torch.int64).set_(storage, 0, (len(values), len(values[0])))
    table.copy_(torch.tensor(values))
    return table


def test_tables_are_rebuilt_for_a_new_tensor_at_the_old_address_and_version():
    storage = torch.UntypedStorage(6 * 8)
    cache = NativeTableCache()
    first = _tables_over(storage, [[0, 1, 2], [1, 2, NIN]])
    built = cache.get(first, NIN)
    assert cache.get(first, NIN) is built  # the same tensor, unchanged: cached
    address, version = first.data_ptr(), first._version
    del first  # as a buffer moved off the device; its replacement lands where it was
    second = _tables_over(storage, [[4, 3, 2], [3, NIN, NIN]])
    assert (second.data_ptr(), second._version) == (address, version)
    rebuilt = cache.get(second, NIN)
    assert rebuilt is not built
    assert torch.equal(rebuilt.knn, second.to(torch.int32))


def test_tables_are_rebuilt_after_an_in_place_edit():
    knn = torch.tensor([[0, 1, 2], [1, 2, NIN]])
    cache = NativeTableCache()
    built = cache.get(knn, NIN)
    knn[1, 2] = 4
    assert torch.equal(cache.get(knn, NIN).knn, knn.to(torch.int32))
    assert cache.get(knn, NIN) is not built


def test_slot_cells_are_part_of_the_key():
    knn = torch.tensor([[0, 1, 2], [1, 2, NIN]])
    cells = torch.zeros_like(knn)
    cache = NativeTableCache()
    without = cache.get(knn, NIN)
    with_cells = cache.get(knn, NIN, cells)
    assert without.cells is None and with_cells.cells is not None
    cells[0, 0] = 1
    assert cache.get(knn, NIN, cells).cells[0, 0] == 1


def test_a_cache_pickles_and_copies_empty():
    knn = torch.tensor([[0, 1, 2], [1, 2, NIN]])
    cache = NativeTableCache()
    built = cache.get(knn, NIN)
    for restored in (pickle.loads(pickle.dumps(cache)), copy.deepcopy(cache)):
        assert restored._entry is None  # a deep copy would otherwise hold copies of the tables
        assert restored.get(knn, NIN) is not built
        assert torch.equal(restored.get(knn, NIN).knn, built.knn)
