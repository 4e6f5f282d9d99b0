"""The self-check's checks of the torch.compile internals: traced tensors, the compile id, AOTAutograd's
cache, the cache keys' tag and how they pickle a DeviceMesh, and resetting compiled code.

Each check gets a ``Probe`` (see ``probe``) and returns what it saw, or raises when torch does not
behave as the package relies on; ``checks.CHECKS`` lists them in the order they run.
"""

from __future__ import annotations

from .probe import Probe, api_module, require


def check_traced_tensors(probe: Probe) -> str:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import FunctionalTensor

    api = api_module()
    with FakeTensorMode():
        fake = torch.empty(2)
    require(api.is_traced(fake) and not api.is_traced(torch.empty(2)), "is_fake does not tell fake tensors")
    require(issubclass(FunctionalTensor, torch.Tensor), "FunctionalTensor")
    return "torch._subclasses.fake_tensor.is_fake, functional_tensor.FunctionalTensor"


def check_compile_id(probe: Probe) -> str:
    from torch._guards import CompileContext

    require(callable(CompileContext.current_compile_id), "torch._guards.CompileContext.current_compile_id is missing")
    require(CompileContext.current_compile_id() is None and api_module().current_compile_id() is None,
             "CompileContext.current_compile_id() is not None outside torch.compile")
    return "torch._guards.CompileContext.current_compile_id(): None outside torch.compile"


def check_aot_autograd_cache(probe: Probe) -> str:
    import inspect

    api = api_module()
    cache = api.aot_autograd_cache()
    require(cache is not None, "torch._functorch._aot_autograd.autograd_cache.AOTAutogradCache.save is missing or "
                                "no staticmethod")
    original = cache.__dict__["save"]
    parameters = list(inspect.signature(original.__func__).parameters)
    require(parameters == ["key", "entry", "remote"], f"AOTAutogradCache.save takes {parameters}")
    # What the lifecycle's compile-cache guard does with it (the package's own wrapper may be installed
    # already: a second one wraps it and gives it back).
    saved = []
    recording = staticmethod(lambda key, entry, remote: saved.append(key))
    api.skipping_save(recording, lambda: True).__func__("skipped", None, False)
    trial = api.skipping_save(recording, lambda: False)
    require(isinstance(trial, staticmethod), "skipping_save does not give a staticmethod")
    trial.__func__("key", None, False)
    require(saved == ["key"], "skipping_save does not skip, or does not call the original save as (key, entry, remote)")
    cache.save = trial
    wrapped = cache.__dict__["save"]
    cache.save = original
    require(wrapped is trial and cache.__dict__["save"] is original,
            "AOTAutogradCache.save could not be replaced by skipping_save's wrapper and restored")
    return "AOTAutogradCache.save, a staticmethod (key, entry, remote), wrapped by skipping_save and restored"


def check_cache_key_tag(probe: Probe) -> str:
    import inspect

    import torch.compiler.config as compiler_config
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCacheDetails
    from torch._inductor.codecache import FxGraphHashDetails

    require(issubclass(AOTAutogradCacheDetails, FxGraphHashDetails),
            "AOTAutogradCacheDetails does not derive from inductor's FxGraphHashDetails")
    require("cache_key_tag" in inspect.getsource(FxGraphHashDetails.__init__),
            "FxGraphHashDetails does not read torch.compiler.config.cache_key_tag into the cache key")
    before = compiler_config.cache_key_tag
    with api_module().cache_key_tagged("mixfix-self-check"):
        require(compiler_config.cache_key_tag.endswith("mixfix-self-check")
                and compiler_config.cache_key_tag.startswith(before),
                "cache_key_tagged does not add its tag to torch.compiler.config.cache_key_tag")
    require(compiler_config.cache_key_tag == before, "the patch of torch.compiler.config.cache_key_tag was not undone")
    return ("torch.compiler.config.cache_key_tag, read into AOTAutograd's and inductor's cache keys, patched by "
            "cache_key_tagged and restored")


def check_dynamo_reset(probe: Probe) -> str:
    import torch

    require(callable(getattr(torch._dynamo, "reset", None)), "torch._dynamo.reset is missing")
    require(callable(api_module().reset_compiled_code), "reset_compiled_code")
    return "torch._dynamo.reset, as reset_compiled_code (not called here: it would drop this process's compiled code)"


def check_device_mesh_cache_key(probe: Probe) -> str:
    import pickle

    import torch
    from torch._inductor.codecache import FxGraphCachePickler
    from torch.distributed.device_mesh import DeviceMesh

    from . import aot_compile

    api = api_module()
    graph = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    original = FxGraphCachePickler.__dict__["__init__"]
    require(DeviceMesh not in FxGraphCachePickler(graph).dispatch_table,
            "FxGraphCachePickler already pickles DeviceMesh its own way")
    with api.device_meshes_keyed_by_groups():
        with api.device_meshes_keyed_by_groups():  # nested: one patch
            keyed = FxGraphCachePickler(graph).dumps(probe.mesh)
        require(isinstance(FxGraphCachePickler(graph).dispatch_table, dict),
                "FxGraphCachePickler has no dispatch_table")
        expected = ("cpu", probe.mesh.mesh.tolist(), probe.mesh.mesh_dim_names, (probe.mesh.get_group(0).group_name,))
        require(aot_compile.mesh_by_groups(probe.mesh) == expected,
                "mesh_by_groups does not give device type, ranks, dim names and group names")
        require(pickle.loads(keyed) == api.device_mesh_cache_key(*expected),
                "a DeviceMesh is not pickled by device type, ranks, dim names and group names "
                "in the FX graph cache key")
    require(FxGraphCachePickler.__dict__["__init__"] is original
            and DeviceMesh not in FxGraphCachePickler(graph).dispatch_table,
            "the patch of FxGraphCachePickler.__init__ was not undone")
    return ("FxGraphCachePickler.__init__ making self.dispatch_table, given a DeviceMesh reduction by "
            "device_meshes_keyed_by_groups and restored")



def check_aot_inductor(probe: Probe) -> str:
    import inspect

    from functorch.compile import aot_function
    from torch._inductor import compile_fx
    from torch._inductor.decomposition import select_decomp_table

    from . import aot_compile

    wanted = {"fn", "fw_compiler", "bw_compiler", "partition_fn", "decompositions", "keep_inference_input_mutations"}
    missing = wanted - set(inspect.signature(aot_function).parameters)
    require(not missing, f"functorch.compile.aot_function takes no {sorted(missing)}")
    require(callable(compile_fx.compile_fx_inner) and "is_backward" in inspect.getsource(compile_fx._CompileFxKwargs),
            "torch._inductor.compile_fx.compile_fx_inner takes no is_backward")
    require(list(inspect.signature(compile_fx.partition_fn).parameters)[:2] == ["gm", "joint_inputs"],
            "torch._inductor.compile_fx.partition_fn is not (gm, joint_inputs, ...)")
    require(isinstance(select_decomp_table(), dict), "torch._inductor.decomposition.select_decomp_table")
    require(callable(aot_compile.aot_inductor_function), "aot_inductor_function")
    leaves, structure = aot_compile.flatten(([1, None], {"b": 2, "a": 3}))
    require(aot_compile.flatten(([4, None], {"b": 5, "a": 6}))[1] == structure and len(leaves) == 4
            and hash(structure) == hash(aot_compile.flatten(([0, None], {"b": 0, "a": 0}))[1])
            and aot_compile.unflatten(leaves, structure) == ([1, None], {"b": 2, "a": 3}),
            "torch.utils._pytree tree_flatten/tree_unflatten (flatten, unflatten): equal structures, a round trip")
    return ("functorch.compile.aot_function with inductor's compile_fx_inner (is_backward), partition_fn and "
            "select_decomp_table, as aot_inductor_function (not compiled here: seconds of C++); torch.utils._pytree as "
            "flatten and unflatten")
