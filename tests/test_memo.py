"""Memo: which factory calls get a tensor back (one call site, once per pass; never two sites), where the mode is active, and that outputs do not change.

The table and the mode are tested directly; the scope (transformer entry to first block) on a stub
transformer that builds an index tensor in its prologue as Qwen-Image does; bitwise equality on tiny
Qwen-Image with `zero_cond_t=True`, through the pipeline and on a bare transformer with an edit-style
`img_shapes` (a target and a condition image, so the index mixes 0 and 1).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import hookkit
from hookkit import AdapterSpec, BlockListSpec
from hookkit.tools import zoo
from hookkit.core.registry import registry_names
from hookkit.core.modes import push_mode, remove_mode
from hookkit.techniques.memo import MemoMode, MemoTable, apply_memo, freeze


def memo_active() -> bool:
    return any(isinstance(m, MemoMode) for m in torch.overrides._get_current_function_mode_stack())


# --- the table and the mode -----------------------------------------------------------------------------------


def passes(table: MemoTable, build, n: int = 2) -> list:
    """`build()` run in `n` passes of the mode, as `n` prologue runs (steps) of a transformer would."""
    out = []
    for _ in range(n):
        with MemoMode(table):
            out.append(build())
    return out


def test_one_call_site_gets_its_tensor_back_at_the_next_pass() -> None:
    table = MemoTable()
    a, b = passes(table, lambda: torch.tensor([[0, 0, 1]], dtype=torch.int))
    assert a is b
    assert table.stats() == {"hits": 1, "misses": 1, "rebuilt": 0, "passed": 0, "overflow": 0, "entries": 1}


def test_two_call_sites_with_equal_values_never_share_a_tensor() -> None:
    """Two equal torch.tensor calls in one prologue, one changed in place: the other keeps its value."""
    table = MemoTable()

    def prologue() -> tuple[torch.Tensor, torch.Tensor]:
        first = torch.tensor([1.0, 2.0])
        second = torch.tensor([1.0, 2.0])
        first.add_(1.0)
        return first, second

    (a1, b1), (a2, b2) = passes(table, prologue)
    assert a1 is not b1 and a2 is not b2
    assert b1.tolist() == [1.0, 2.0] and b2.tolist() == [1.0, 2.0] and a2.tolist() == [2.0, 3.0]
    assert table.stats()["rebuilt"] == 1  # the site whose tensor was changed in place got a fresh one


def test_one_call_site_run_twice_in_a_pass_gives_two_tensors() -> None:
    table = MemoTable()
    ((a, b),) = passes(table, lambda: [torch.tensor([0, 1]) for _ in range(2)], n=1)
    assert a is not b and a.tolist() == b.tolist() == [0, 1]
    (again,) = passes(table, lambda: [torch.tensor([0, 1]) for _ in range(2)], n=1)
    assert again[0] is not again[1]


def test_list_and_tuple_of_equal_values_give_one_tensor() -> None:
    table = MemoTable()
    a, b = (passes(table, lambda: torch.tensor(data), n=1)[0] for data in ([[0, 1], [1, 0]], ((0, 1), (1, 0))))
    assert a is b


def test_different_values_give_different_tensors() -> None:
    with MemoMode(MemoTable()):
        a = torch.tensor([0, 1])
        b = torch.tensor([1, 0])
    assert a is not b
    assert a.tolist() == [0, 1] and b.tolist() == [1, 0]


@pytest.mark.parametrize("other", [[1.0, 2.0], [True, True], [1, 2.0]])
def test_values_of_other_python_types_give_different_tensors(other: list) -> None:
    with MemoMode(MemoTable()):
        ints = torch.tensor([1, 2])
        mixed = torch.tensor(other)
    assert ints is not mixed
    assert ints.dtype == torch.int64 and mixed.dtype == torch.tensor(other).dtype


def test_zero_and_negative_zero_give_different_tensors() -> None:
    with MemoMode(MemoTable()):
        pos = torch.tensor([0.0])
        neg = torch.tensor([-0.0])
    assert pos is not neg
    assert torch.signbit(neg).item() and not torch.signbit(pos).item()


def test_different_dtypes_give_different_tensors() -> None:
    with MemoMode(MemoTable()):
        as_int = torch.tensor([1, 2], dtype=torch.int)
        as_long = torch.tensor([1, 2], dtype=torch.long)
        inferred = torch.tensor([1, 2])
    assert as_int is not as_long and inferred is not as_long  # an omitted dtype is its own key
    assert (as_int.dtype, as_long.dtype, inferred.dtype) == (torch.int32, torch.int64, torch.int64)


def test_default_dtype_is_part_of_the_key() -> None:
    table = MemoTable()
    with MemoMode(table):
        single = torch.tensor([0.5])
        saved = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            double = torch.tensor([0.5])
        finally:
            torch.set_default_dtype(saved)
    assert single is not double
    assert (single.dtype, double.dtype) == (torch.float32, torch.float64)


def test_different_devices_give_different_tensors() -> None:
    table = MemoTable()

    def build(device) -> torch.Tensor:
        return torch.tensor([1, 2], device=device)

    cpu, meta, cpu_again = (passes(table, lambda: build(d), n=1)[0] for d in ("cpu", "meta", torch.device("cpu")))
    assert cpu is not meta
    assert (cpu.device.type, meta.device.type) == ("cpu", "meta")
    assert cpu_again is cpu


def test_as_tensor_of_a_python_number_is_memoized() -> None:
    table = MemoTable()
    a, b = passes(table, lambda: torch.as_tensor(7, dtype=torch.int32))
    [c] = passes(table, lambda: torch.as_tensor(7), n=1)
    assert a is b and a is not c
    assert (a.dtype, c.dtype) == (torch.int32, torch.int64)
    assert table.stats()["hits"] == 1 and table.stats()["misses"] == 2


def test_non_plain_data_and_other_arguments_are_not_memoized() -> None:
    table = MemoTable()
    elements = [torch.tensor(1), torch.tensor(2)]
    with MemoMode(table):
        from_tensor = [torch.tensor(elements) for _ in range(2)]
        grad = [torch.tensor([1.0], requires_grad=True) for _ in range(2)]
    assert from_tensor[0] is not from_tensor[1] and grad[0] is not grad[1]
    assert table.stats() == {"hits": 0, "misses": 0, "rebuilt": 0, "passed": 4, "overflow": 0, "entries": 0}


def test_tensor_modified_in_place_is_rebuilt() -> None:
    table = MemoTable()

    def build() -> torch.Tensor:
        return torch.tensor([1, 2])

    [first] = passes(table, build, n=1)
    first.add_(10)
    [second] = passes(table, build, n=1)
    assert second is not first
    assert second.tolist() == [1, 2]
    assert table.stats()["rebuilt"] == 1


def test_tensor_made_to_require_grad_is_rebuilt() -> None:
    table = MemoTable()

    def build() -> torch.Tensor:
        return torch.tensor([1.0])

    [first] = passes(table, build, n=1)
    first.requires_grad_()  # no version bump, but stock would hand the next caller a tensor without grad
    [second] = passes(table, build, n=1)
    assert second is not first and second.requires_grad is False
    assert table.stats()["rebuilt"] == 1


def test_under_inference_mode_a_site_gets_one_tensor_that_keeps_a_version_counter() -> None:
    table = MemoTable()

    def build() -> torch.Tensor:
        return torch.tensor([1, 2])

    with torch.inference_mode():
        a, b = passes(table, build)
        a.add_(10)  # allowed on a normal tensor in inference mode, and counted
        [c] = passes(table, build, n=1)
    assert a is b and a.is_inference() is False
    assert c is not a and c.tolist() == [1, 2]
    assert table.stats() == {"hits": 1, "misses": 1, "rebuilt": 1, "passed": 0, "overflow": 0, "entries": 1}


def test_tensor_memoized_under_inference_mode_serves_a_later_call_with_autograd() -> None:
    table = MemoTable()

    def build() -> torch.Tensor:
        return torch.tensor([2.0])

    with torch.inference_mode():
        [first] = passes(table, build, n=1)
    weight = torch.ones(1, requires_grad=True)
    [again] = passes(table, build, n=1)
    (weight * again).sum().backward()  # an inference tensor here: "Inference tensors cannot be saved for backward"
    assert again is first and weight.grad.tolist() == [2.0]


def test_numpy_data_is_not_memoized() -> None:
    # torch.as_tensor shares a numpy array's memory: the array may change between calls
    table = MemoTable()
    array = np.array([1, 2])
    with MemoMode(table):
        before = torch.as_tensor(array)
        array[0] = 5
        after = torch.as_tensor(array)
        scalars = torch.tensor([np.int64(1), np.int64(2)])
    assert before.tolist() == [5, 2] and after.tolist() == [5, 2] and scalars.tolist() == [1, 2]
    assert table.stats() == {"hits": 0, "misses": 0, "rebuilt": 0, "passed": 3, "overflow": 0, "entries": 0}


def test_full_table_keeps_its_entries_and_builds_new_values_unstored() -> None:
    # entries are never evicted: a CUDA graph captured over the prologue may still read them
    table = MemoTable(max_entries=2)

    def build() -> tuple[torch.Tensor, ...]:
        return torch.tensor([1]), torch.tensor([2]), torch.tensor([3])

    (a, b, c1), (a2, b2, c2) = passes(table, build)
    assert a2 is a and b2 is b
    assert c1 is not c2 and c1.tolist() == [3]
    assert table.stats() == {"hits": 2, "misses": 2, "rebuilt": 0, "passed": 0, "overflow": 2, "entries": 2}


def test_freeze_keys_plain_data_only() -> None:
    assert freeze([1, 2]) == freeze((1, 2))
    assert freeze([1, 2]) != freeze([1.0, 2.0]) != freeze([True, True])
    assert freeze([[0, 1], [1.5]]) is not None
    assert freeze([1, "a"]) is None and freeze([torch.tensor(1)]) is None and freeze(None) is None


def test_remove_mode_from_below_another_mode_keeps_the_other() -> None:
    ours, theirs = MemoMode(MemoTable()), MemoMode(MemoTable())
    push_mode(ours)
    push_mode(theirs)
    try:
        assert remove_mode(ours) is True
        assert torch.overrides._get_current_function_mode_stack() == [theirs]
    finally:
        remove_mode(theirs)
        remove_mode(ours)
    assert torch.overrides._get_current_function_mode_stack() == []


# --- the scope, on a stub transformer ------------------------------------------------------------------------


class StubMemoBlock(nn.Module):
    def __init__(self, seen: list[bool]) -> None:
        super().__init__()
        self.seen = seen

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, index: torch.Tensor):
        self.seen.append(memo_active())
        return encoder_hidden_states, hidden_states + index


class StubMemoTransformer(nn.Module):
    """Builds its index tensor from Python lists in the prologue, as Qwen-Image's forward does."""

    def __init__(self, num_blocks: int = 3) -> None:
        super().__init__()
        self.seen: dict[str, list[bool]] = {"prologue": [], "blocks": [], "epilogue": []}
        self.blocks = nn.ModuleList(StubMemoBlock(self.seen["blocks"]) for _ in range(num_blocks))

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                shapes: list[tuple[int, int]], fail: bool = False, skip_blocks: bool = False):
        index = torch.tensor([[0] * a + [1] * b for a, b in shapes], dtype=torch.int)
        self.seen["prologue"].append(memo_active())
        if fail:
            raise ValueError("prologue failed")
        if skip_blocks:
            return hidden_states
        for block in self.blocks:
            encoder_hidden_states, hidden_states = block(hidden_states, encoder_hidden_states, index)
        self.seen["epilogue"].append(memo_active())
        return hidden_states


STUB_ADAPTER = AdapterSpec(
    name="stub-memo", transformer=("StubMemoTransformer",), memo_scope="prologue",
    blocks=(BlockListSpec(attr="blocks", classes=("StubMemoBlock",), encoder_arg="encoder_hidden_states",
                         returns=("encoder_hidden_states", "hidden_states")),),
)


def run_stub(model: StubMemoTransformer, **kwargs) -> torch.Tensor:
    return model(torch.zeros(1, 5), torch.zeros(1, 2), shapes=[(2, 3)], **kwargs)


def test_mode_is_active_in_the_prologue_and_nowhere_else() -> None:
    model = StubMemoTransformer()
    memo = apply_memo(model, adapter=STUB_ADAPTER)
    run_stub(model)
    run_stub(model)
    memo.remove()
    assert model.seen == {"prologue": [True, True], "blocks": [False] * 6, "epilogue": [False, False]}
    assert memo_active() is False


def test_stub_index_is_built_once_across_calls() -> None:
    model = StubMemoTransformer()
    memo = apply_memo(model, adapter=STUB_ADAPTER)
    outputs = [run_stub(model) for _ in range(3)]
    stats = memo.table.stats()
    memo.remove()
    assert (stats["misses"], stats["hits"]) == (1, 2)
    assert all(torch.equal(o, outputs[0]) for o in outputs)


def test_scope_closes_when_the_prologue_raises() -> None:
    model = StubMemoTransformer()
    memo = apply_memo(model, adapter=STUB_ADAPTER)
    with pytest.raises(ValueError, match="prologue failed"):
        run_stub(model, fail=True)
    assert memo_active() is False
    run_stub(model)  # and the next call opens it again
    memo.remove()
    assert model.seen["prologue"] == [True, True] and model.seen["blocks"] == [False] * 3


def test_scope_closes_at_exit_when_no_block_ran() -> None:
    model = StubMemoTransformer()
    memo = apply_memo(model, adapter=STUB_ADAPTER)
    run_stub(model, skip_blocks=True)
    assert memo_active() is False
    memo.remove()


def test_remove_leaves_the_transformer_as_it_was() -> None:
    model = StubMemoTransformer()
    before = {name: dict(m.__dict__) for name, m in model.named_modules()}
    memo = apply_memo(model, adapter=STUB_ADAPTER)
    run_stub(model)
    memo.remove()
    after = {name: dict(m.__dict__) for name, m in model.named_modules()}
    assert after.keys() == before.keys()
    for name in before:
        assert after[name].keys() == before[name].keys()
        assert all(after[name][k] is before[name][k] for k in before[name])
    assert registry_names(model) == () and registry_names(model.blocks[0]) == ()


# --- enable(): plan, summary, Qwen-Image ----------------------------------------------------------------------


def test_plan_puts_the_prologue_hook_on_the_transformer_and_the_closing_hook_on_the_first_block() -> None:
    pipe = zoo.tiny_pipeline("qwenimage", zero_cond_t=True)
    plan = hookkit.build_plan(pipe, hookkit.Spec(memo=True))
    assert plan.targets("memo") == [("", "hookkit.memo.prologue"), ("transformer_blocks.0", "hookkit.memo.first_block")]


def test_adapter_without_memo_scope_attaches_nothing_and_says_so() -> None:
    pipe = zoo.tiny_pipeline("cogvideox")
    handle = hookkit.enable(pipe, hookkit.Spec(memo=True))
    try:
        assert handle.plan.targets("memo") == []
        summary = handle.summary().features["memo"]
        assert summary.data == {"scope": "none", "attached": False, "reason": "adapter 'cogvideox' declares "
                                "memo_scope='none' (no per-step host-data tensors known)"}
        assert summary.text == summary.data["reason"] + ": nothing attached"
    finally:
        handle.remove()


def test_whole_transformer_compile_attaches_nothing() -> None:
    pipe = zoo.tiny_pipeline("qwenimage", zero_cond_t=True)
    plan = hookkit.build_plan(pipe, hookkit.Spec(memo=True, compile=hookkit.Compile(regional=False)))
    assert plan.targets("memo") == []


def test_memo_stands_aside_when_the_first_block_is_compiled_by_module_compile() -> None:
    model = StubMemoTransformer()
    memo = apply_memo(model, adapter=STUB_ADAPTER)
    model.blocks[0].compile(backend="eager")  # what diffusers' compile_repeated_blocks does
    try:
        run_stub(model)
    finally:
        model.blocks[0]._compiled_call_impl = None
        memo.remove()
    assert model.seen["prologue"] == [False]
    assert memo.table.stats()["misses"] == 0


def test_qwenimage_zero_cond_t_pipeline_is_bitwise_equal_and_builds_modulate_index_once() -> None:
    pipe = zoo.tiny_pipeline("qwenimage", zero_cond_t=True)
    stock = pipe(**zoo.call_kwargs("qwenimage", steps=4)).images
    handle = hookkit.enable(pipe, hookkit.Spec(memo=True))
    hooked = pipe(**zoo.call_kwargs("qwenimage", steps=4)).images
    hooked_again = pipe(**zoo.call_kwargs("qwenimage", steps=4)).images
    data = handle.summary().features["memo"].data
    handle.remove()
    assert torch.equal(stock, hooked) and torch.equal(stock, hooked_again)
    # one torch.tensor per transformer call (the all-ones prompt mask is dropped by the pipeline, so
    # compute_text_seq_len_from_mask's as_tensor does not run); built once in 8 calls over two generations
    assert (data["misses"], data["hits"], data["rebuilt"], data["passed"], data["entries"]) == (1, 7, 0, 0, 1)


def test_qwenimage_pipeline_under_inference_mode_is_bitwise_equal() -> None:
    pipe = zoo.tiny_pipeline("qwenimage", zero_cond_t=True)
    with torch.inference_mode():
        stock = pipe(**zoo.call_kwargs("qwenimage", steps=3)).images
    handle = hookkit.enable(pipe, hookkit.Spec(memo=True))
    try:
        with torch.inference_mode():
            hooked = pipe(**zoo.call_kwargs("qwenimage", steps=3)).images
        data = handle.summary().features["memo"].data
    finally:
        handle.remove()
    assert torch.equal(stock, hooked)
    assert (data["misses"], data["hits"], data["rebuilt"]) == (1, 2, 0)


def test_qwenimage_mode_is_on_in_the_prologue_and_off_in_blocks_and_epilogue() -> None:
    pipe = zoo.tiny_pipeline("qwenimage", zero_cond_t=True)
    transformer = pipe.transformer
    seen: dict[str, list[bool]] = {}
    probes = {"txt_in (prologue)": transformer.txt_in, "pos_embed (prologue)": transformer.pos_embed,
              **{f"block {i}": b.img_mod for i, b in enumerate(transformer.transformer_blocks)},  # inside the block
              "norm_out (epilogue)": transformer.norm_out}
    handles = [m.register_forward_pre_hook(lambda m, a, name=name: seen.setdefault(name, []).append(memo_active()))
               for name, m in probes.items()]
    handle = hookkit.enable(pipe, hookkit.Spec(memo=True))
    try:
        pipe(**zoo.call_kwargs("qwenimage", steps=2))
    finally:
        handle.remove()
        for h in handles:
            h.remove()
    assert seen == {"txt_in (prologue)": [True] * 2, "pos_embed (prologue)": [True] * 2, "block 0": [False] * 2,
                    "block 1": [False] * 2, "block 2": [False] * 2, "norm_out (epilogue)": [False] * 2}


def test_qwenimage_bare_transformer_with_condition_image_is_bitwise_equal() -> None:
    transformer = zoo.tiny_transformer("qwenimage", zero_cond_t=True)
    g = torch.Generator().manual_seed(0)
    img_shapes = [[(1, 2, 2), (1, 2, 2)]]  # target + condition image: modulate_index = [0]*4 + [1]*4
    kwargs = dict(hidden_states=torch.randn(1, 8, 16, generator=g), encoder_hidden_states=torch.randn(1, 6, 16, generator=g),
                  encoder_hidden_states_mask=torch.tensor([[1, 1, 1, 1, 0, 0]]), timestep=torch.tensor([0.5]),
                  img_shapes=img_shapes, return_dict=False)
    stock = [transformer(**kwargs)[0] for _ in range(2)]
    handle = hookkit.enable(transformer, hookkit.Spec(memo=True))
    with handle.generation(num_steps=2):
        hooked = [transformer(**kwargs)[0] for _ in range(2)]
    data = handle.summary().features["memo"].data
    handle.remove()
    assert all(torch.equal(s, h) for s, h in zip(stock, hooked))
    # per call: torch.tensor(modulate_index) and torch.as_tensor(text_seq_len) (the mask has padding)
    assert (data["misses"], data["hits"], data["entries"]) == (2, 2, 2)
