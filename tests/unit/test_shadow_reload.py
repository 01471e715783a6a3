"""engine/shadow_reload: the shadow shares nothing a reload writes with the served model, and swap makes the
served model compute what the shadow computes. (Real vLLM reloads through it in
tests/integration/test_weights.py and test_tied_push.py: samples and log-probs match the pushed weights.)"""
import torch
from torch import nn

from rollout_service.engine.shadow_reload import make_shadow, swap


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4, bias=False)
        self.norm = nn.LayerNorm(4)
        self.register_buffer("scale", torch.ones(4))
        self.kv_cache = [torch.zeros(2, 4)]           # engine state a reload never writes: shared
        self.proj.cpu_linear = "packed-v0"           # what vLLM's CPU processing sets on linear layers


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight          # tied


def test_shadow_shares_no_tensor_or_registry_with_the_served_model():
    net = Net()
    shadow = make_shadow(net)
    served = {id(t) for t in list(net.parameters()) + list(net.buffers())}
    assert not served & {id(t) for t in list(shadow.root.parameters()) + list(shadow.root.buffers())}
    for live, sh in shadow.pairs:
        assert live is not sh and live._parameters is not sh._parameters and live._buffers is not sh._buffers
    assert shadow.root.head.weight is shadow.root.embed.weight          # ties survive
    assert shadow.root.blocks[0].kv_cache is net.blocks[0].kv_cache


def test_loading_the_shadow_changes_nothing_served_until_the_swap():
    net = Net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    weight_obj, embed_obj = net.blocks[1].proj.weight, net.embed.weight
    shadow = make_shadow(net)
    with torch.no_grad():                             # what a reload does to the shadow
        shadow.root.embed.weight.fill_(3.0)
        shadow.root.blocks[1].norm.weight.fill_(2.0)
        shadow.root.blocks[1].scale.fill_(5.0)
        shadow.root.blocks[1].proj.weight = nn.Parameter(torch.empty(0), requires_grad=False)   # packed away
        shadow.root.blocks[1].proj.cpu_linear = "packed-v1"
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert net.blocks[1].proj.cpu_linear == "packed-v0"

    swap(shadow)
    assert net.embed.weight is embed_obj and torch.all(net.embed.weight == 3.0)   # copied in place
    assert net.head.weight is net.embed.weight
    assert torch.all(net.blocks[1].norm.weight == 2.0) and torch.all(net.blocks[1].scale == 5.0)
    assert net.blocks[1].proj.cpu_linear == "packed-v1" and net.blocks[0].proj.cpu_linear == "packed-v0"
    assert net.blocks[1].proj.weight is weight_obj and weight_obj.numel() == 0    # form changed: data moved
    assert torch.equal(net.blocks[0].proj.weight, before["blocks.0.proj.weight"])


class LoaderLinear(nn.Linear):
    """A linear layer whose weight carries a loader bound to the layer, as vLLM's parameters do."""

    def __init__(self):
        super().__init__(4, 4, bias=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded):
        param.data.copy_(loaded)


def test_released_shadow_is_freed():
    """vLLM's reload registry is keyed weakly by module, but a shadow's entries hold loaders bound to the
    shadow: until release() drops them, every commit's shadow (and all it loaded) stayed alive."""
    import gc
    import weakref

    from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading

    from rollout_service.engine.shadow_reload import release

    net = nn.Sequential(LoaderLinear(), LoaderLinear())
    record_metadata_for_reloading(net)

    def commit(do_release: bool):
        shadow = make_shadow(net)
        gone = weakref.ref(shadow.root[0])
        swap(shadow)
        if do_release:
            release(shadow)
        del shadow
        gc.collect()
        return gone() is None

    assert not commit(do_release=False)            # the leak this guards against is real
    assert commit(do_release=True)


def test_released_shadow_is_freed_without_the_cyclic_collector():
    """release() breaks the cycles through the shadow's own registries (loaders bound to the shadow), so a
    shadow holding only those is freed by refcount, with the collector off."""
    import gc
    import weakref

    from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading

    from rollout_service.engine.shadow_reload import release

    net = nn.Sequential(LoaderLinear(), LoaderLinear())
    record_metadata_for_reloading(net)
    gc.collect()
    gc.disable()
    try:
        shadow = make_shadow(net)
        for layer in shadow.root:                   # what a reload leaves: new tensors, loaders bound to the shadow
            layer.weight = nn.Parameter(layer.weight.data.clone(), requires_grad=False)
            layer.weight.weight_loader = layer.weight_loader
        gone = [weakref.ref(m) for _, m in shadow.pairs] + [weakref.ref(shadow.root[1].weight)]
        swap(shadow)
        release(shadow)
        del shadow, layer
        assert all(ref() is None for ref in gone)
    finally:
        gc.enable()
    assert torch.equal(net[0].weight, net[0].weight) and net[1].weight.numel() == 16   # served model intact


def test_a_quantized_layers_kernel_is_its_own_in_the_shadow():
    """compressed-tensors keeps a layer's packed weights on `layer.scheme.kernel` (CPU int8: the oneDNN handle), not
    on the layer: the shadow's processing must re-pack its own kernel, and the served one only changes at the swap."""
    class Kernel:
        dnnl_handler = "packed-v0"

    class Scheme:
        def __init__(self):
            self.kernel = Kernel()

    net = Net()
    net.blocks[0].proj.scheme = Scheme()
    served_kernel = net.blocks[0].proj.scheme.kernel
    shadow = make_shadow(net)
    shadow.root.blocks[0].proj.scheme.kernel.dnnl_handler = "packed-v1"       # what the reload's processing does
    assert served_kernel.dnnl_handler == "packed-v0" and net.blocks[0].proj.scheme.kernel is served_kernel
    swap(shadow)
    assert net.blocks[0].proj.scheme.kernel.dnnl_handler == "packed-v1"
