import copy
import gc

import numpy as np
import pytest
import torch

from knnconv import KNNConvPlan, compact_tables, make_plan

# Cin = 2, Nin = 5, K = 3, Nout = 2, V = 4; entry 5 (= Nin) is the padding neighbour.
KNN = torch.tensor([[0, 4], [5, 1], [3, 5]])
RF = torch.tensor([[1, 0, 3], [2, 2, 0]])
CIN, NIN, V, COUT = 2, 5, 4, 3
PADDING_SLOT = CIN * NIN

# Slot p = c*K + k: input c*Nin + knn[k, n] (padding -> Cin*Nin), weight c*V + rf[n, k].
EXPECTED_INPUT = [[0, PADDING_SLOT, 3, 5, PADDING_SLOT, 8],
                  [4, 1, PADDING_SLOT, 9, 6, PADDING_SLOT]]
EXPECTED_WEIGHT = [[1, 0, 3, 5, 4, 7],
                   [2, 2, 0, 6, 6, 4]]


def base_arguments():
    return {"knn_indices": KNN.clone(), "rf_index": RF.clone(), "nin": NIN, "v": V, "cin": CIN,
            "cout": COUT}


def with_entry(table, value):
    table = table.clone()
    table[-1, -1] = value
    return table


def test_compact_tables_hand_built_example():
    input_linear, weight_linear = compact_tables(KNN, RF, CIN, NIN, V)

    assert input_linear.dtype == weight_linear.dtype == torch.int32
    assert input_linear.shape == weight_linear.shape == (2, 64)
    assert input_linear[:, :6].tolist() == EXPECTED_INPUT
    assert weight_linear[:, :6].tolist() == EXPECTED_WEIGHT
    # Slots past Cin*K only pad the kernel tiles: zero input, weight column 0.
    assert (input_linear[:, 6:] == PADDING_SLOT).all()
    assert (weight_linear[:, 6:] == 0).all()


def test_plan_tables_match_compact_tables():
    tables = make_plan(**base_arguments()).on("cpu")

    assert tables.input_linear[:, :6].tolist() == EXPECTED_INPUT
    assert tables.weight_linear[:, :6].tolist() == EXPECTED_WEIGHT
    assert tables.knn_indices.dtype == tables.rf_index.dtype == torch.int64
    assert torch.equal(tables.knn_indices, KNN)
    assert torch.equal(tables.rf_index, RF)


def test_device_tables_copy_the_compact_tables_only_when_asked():
    # the channels-last kernels never read them, and they are a plan's largest tables
    plan = make_plan(**base_arguments())
    tables = plan.on("meta")

    assert "compact" not in tables.derived
    assert tables.knn_indices.device.type == "meta"
    assert tables.input_linear.device.type == tables.weight_linear.device.type == "meta"
    assert tables.input_linear.shape == plan.on("cpu").input_linear.shape
    assert tables.derived["compact"][0] is tables.input_linear  # copied once, then kept
    assert "compact" not in copy.deepcopy(plan).on("meta").derived


@pytest.mark.parametrize(("cin", "k", "p64"), [(1, 1, 64), (8, 8, 64), (13, 5, 128),
                                               (3, 49, 192), (64, 9, 576)])
def test_make_plan_sizes(cin, k, p64):
    nin, nout, v = 11, 6, 49
    knn = torch.arange(k * nout).remainder(nin + 1).view(k, nout)
    rf = torch.arange(nout * k).remainder(v).view(nout, k)

    plan = make_plan(knn, rf, nin=nin, v=v, cin=cin, cout=5)

    assert (plan.cin, plan.cout, plan.nin, plan.nout, plan.k, plan.v) == (cin, 5, nin, nout, k, v)
    assert (plan.p, plan.p64, plan.q) == (cin * k, p64, cin * v)
    assert plan.on("cpu").input_linear.shape == (nout, p64)
    assert plan.padding_fraction == pytest.approx((knn == nin).sum().item() / (k * nout))


def test_padding_fraction_and_repr():
    plan = make_plan(**base_arguments())

    assert plan.padding_fraction == pytest.approx(2 / 6)
    for text in ("cin=2", "cout=3", "nin=5", "nout=2", "k=3", "v=4", "p64=64"):
        assert text in repr(plan)


def test_tables_are_cached_per_device():
    plan = make_plan(**base_arguments())

    assert plan.on("cpu") is plan.on(torch.device("cpu"))


def test_derived_builds_once_per_key():
    plan = make_plan(**base_arguments())
    calls = []

    def build(tables):
        calls.append(tables)
        return tables.input_linear.sum()

    first = plan.derived("cpu", "test.sum", build)
    second = plan.derived("cpu", "test.sum", build)
    other = plan.derived("cpu", "test.other", lambda tables: "other")

    assert first is second
    assert calls == [plan.on("cpu")]
    assert other == "other"


def test_the_handle_names_the_sizes_and_tables():
    # a string: torch.compile keeps it a constant of the graph; equal only for plans that
    # compute the same thing, so a graph compiled (and cached on disk) for one serves the other
    plan = make_plan(**base_arguments())
    twin = make_plan(**base_arguments())
    others = [make_plan(**{**base_arguments(), "cout": COUT + 1}),
              make_plan(**{**base_arguments(), "rf_index": with_entry(RF, 1)})]

    assert isinstance(plan.handle, str) and plan.handle == twin.handle
    assert len({plan.handle, *(other.handle for other in others)}) == 3
    assert KNNConvPlan.from_handle(plan.handle) in (plan, twin)
    assert KNNConvPlan.from_handle(others[1].handle) is others[1]


def test_a_handle_names_a_plan_while_one_of_its_twins_lives():
    plan = make_plan(**base_arguments())
    handle, twin = plan.handle, copy.deepcopy(plan)
    del plan
    gc.collect()
    assert KNNConvPlan.from_handle(handle) is twin
    del twin
    gc.collect()
    with pytest.raises(RuntimeError, match="names no live plan"):
        KNNConvPlan.from_handle(handle)


def test_numpy_tables_are_accepted():
    knn = KNN.numpy().astype(np.int32).T.copy().T  # a non-contiguous int32 view
    plan = make_plan(knn, RF.numpy().astype(np.int16), nin=NIN, v=V, cin=CIN, cout=COUT)

    assert torch.equal(plan.knn_indices, KNN)
    assert torch.equal(plan.rf_index, RF)
    assert plan.on("cpu").input_linear[:, :6].tolist() == EXPECTED_INPUT


BAD_ARGUMENTS = {
    "float_knn": ("knn_indices", lambda t: t.float(), TypeError,
                  "knn_indices must have an integer dtype"),
    "bool_knn": ("knn_indices", lambda t: t > 0, TypeError,
                 "knn_indices must have an integer dtype"),
    "list_knn": ("knn_indices", lambda t: t.tolist(), TypeError,
                 "knn_indices must be a torch.Tensor or numpy array"),
    "float_rf": ("rf_index", lambda t: t.double(), TypeError,
                 "rf_index must have an integer dtype"),
    "knn_1d": ("knn_indices", lambda t: t.flatten(), ValueError, "knn_indices must be 2-D"),
    "knn_empty": ("knn_indices", lambda t: t[:0], ValueError, "knn_indices must have K >= 1"),
    "rf_transposed": ("rf_index", lambda t: t.t(), ValueError, "one of them is transposed"),
    "knn_negative": ("knn_indices", lambda t: with_entry(t, -1), ValueError,
                     r"knn_indices entries must lie in \[0, nin\]"),
    "knn_past_padding": ("knn_indices", lambda t: with_entry(t, NIN + 1), ValueError,
                         r"knn_indices entries must lie in \[0, nin\]"),
    "rf_negative": ("rf_index", lambda t: with_entry(t, -1), ValueError,
                    r"rf_index entries must lie in \[0, v\)"),
    "rf_equal_v": ("rf_index", lambda t: with_entry(t, V), ValueError,
                   r"rf_index entries must lie in \[0, v\)"),
    "float_nin": ("nin", float, TypeError, "nin must be an int"),
    "str_v": ("v", str, TypeError, "v must be an int"),
    "bool_cin": ("cin", lambda c: True, TypeError, "cin must be an int"),
    "zero_cout": ("cout", lambda c: 0, ValueError, "cout must be >= 1"),
    "negative_v": ("v", lambda v: -V, ValueError, "v must be >= 1"),
    "int32_overflow": ("cin", lambda c: 2**31 // NIN + 1, ValueError, "must fit in int32"),
}


@pytest.mark.parametrize(("name", "transform", "error", "match"), BAD_ARGUMENTS.values(),
                         ids=list(BAD_ARGUMENTS))
def test_make_plan_rejects(name, transform, error, match):
    arguments = base_arguments()
    arguments[name] = transform(arguments[name])

    with pytest.raises(error, match=match):
        make_plan(**arguments)


def test_numpy_integer_sizes_are_accepted():
    plan = KNNConvPlan(KNN, RF, nin=np.int64(NIN), v=np.int32(V), cin=CIN, cout=COUT)

    assert (plan.nin, plan.v) == (NIN, V)
    assert type(plan.nin) is int


def test_a_transposed_knn_table_is_named_as_the_fault():
    knn = torch.randint(0, 10, (4, 7))
    rf = torch.randint(0, 5, (7, 4))
    with pytest.raises(ValueError, match=r"knn_indices must be \[K, Nout\], rf_index \[Nout, K\]"):
        make_plan(knn.t().contiguous(), rf, nin=10, v=5, cin=2, cout=3)


def test_a_plan_pickled_with_its_compact_tables_as_fields_still_serves_them():
    plan = make_plan(**base_arguments())
    state = plan.__getstate__()
    host = vars(state["_host"])
    # what an older version pickled: the two tables as fields of the host tables
    host["input_linear"], host["weight_linear"] = host.pop("compact")
    older = KNNConvPlan.__new__(KNNConvPlan)
    older.__setstate__(state)
    assert older.on("cpu").input_linear[:, :6].tolist() == EXPECTED_INPUT
    assert older.on("meta").weight_linear.shape == plan.on("cpu").weight_linear.shape


def test_a_plan_pickled_before_it_counted_its_entries_still_counts_them():
    knn = torch.tensor([[0, 1, 3], [2, 3, 1]])  # Nin = 3 pads two slots
    plan = make_plan(knn, torch.zeros(3, 2, dtype=torch.int64), nin=3, v=1, cin=2, cout=2)
    state = plan.__getstate__()
    state.pop("entry_count", None)  # what an older version pickled
    older = KNNConvPlan.__new__(KNNConvPlan)
    older.__setstate__(state)
    assert older.entry_count == plan.entry_count == 4


def test_a_fresh_plan_counts_its_entries_so_torch_compile_traces_no_count():
    """entry_count is counted when the plan is built: counted on first use inside a compiled
    call (auto's dispatch reads it), its .item() would break the graph there."""
    knn = torch.tensor([[0, 1, 3], [2, 3, 1]])
    plan = make_plan(knn, torch.zeros(3, 2, dtype=torch.int64), nin=3, v=1, cin=2, cout=2)
    torch._dynamo.reset()
    scaled = torch.compile(lambda x: x * plan.entry_count, fullgraph=True, backend="eager")
    assert torch.equal(scaled(torch.ones(2)), torch.full((2,), 4.0))
