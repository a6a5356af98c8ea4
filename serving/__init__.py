"""A thin serving loop: a mini DeepSeek-V3-style MoE model served over an emulated pod (DESIGN.md section 8).

    from serving import MINI, init_weights, EmulatedRunner, Engine, SamplingParams, ReferenceModel
    w = init_weights(MINI, seed=0)
    res = Engine(EmulatedRunner(w, groups=2)).generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=4))
    assert [r.output_tokens for r in res.requests] == [ReferenceModel(w).generate(p, 4) for p in ([1, 2, 3], [4, 5])]

Layers: ``config`` (mini / V3 shapes), ``model`` (weights, loader hook, plain-torch reference), ``batch`` (the engine
<-> runner seam), ``runner`` (one step on the emulated pod, every op a kernel), ``request`` / ``kv_cache`` /
``scheduler`` / ``engine`` (requests, paged latent cache with prefix reuse, DP balancing, PD disaggregation, MTP,
faults), ``step`` (the step builder: one pod, parts of queued kernels), ``deployment`` (the decode deployment as data,
``PRESETS``), ``timing`` / ``layer_parts`` (the V3 decode step, timing-only, on the step builder), ``expert_pipeline``
(disaggregated MoE-attention: persistent receive / grouped-GEMM / send kernels on expert dies, DP domains of attention
dies taking turns), ``ops`` (the ``ascend-emu demo`` part, ``serve-model``, ``model expert-pipeline``).
"""
import lazy_loader

# public name -> the module that defines it, imported on first use: ``model`` and ``runner`` import torch (about 2 s
# of CPU), which the timing-only commands (``ascend-emu model decode-layer``, ``serve-model``) never need
_EXPORTS = {name: module for module, names in {
    "batch": ("DieFailure", "SeqWork", "StepBatch", "StepOutput"),
    "config": ("MINI", "V3", "ModelConfig", "get_config"),
    "deployment": ("PRESETS", "Deployment", "resolve"),
    "engine": ("Engine", "Metrics", "PDConfig", "RequestResult", "Results"),
    "expert_pipeline": ("ExpertPipeline", "PipelineResult", "StreamSplit", "pipeline_reference"),
    "kv_cache": ("BlockPool",),
    "model": ("ModelWeights", "ReferenceModel", "init_weights", "load_deepseek_state_dict", "to_deepseek_state_dict"),
    "request": ("Request", "SamplingParams"),
    "runner": ("EmulatedRunner",),
    "scheduler": ("Scheduler", "pd_source_rank"),
    "timing": ("CoreSplit", "DecodeStepTiming", "LayerTiming", "decode_step_timing", "layer_timing"),
}.items() for name in names}


# resolved on first use and then kept on the package (lazy_loader caches it)
__getattr__, _, _ = lazy_loader.attach(__name__, submod_attrs={
    module: [n for n, m in _EXPORTS.items() if m == module] for module in set(_EXPORTS.values())})


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = ["MINI", "V3", "ModelConfig", "get_config", "ModelWeights", "init_weights", "ReferenceModel",
           "load_deepseek_state_dict", "to_deepseek_state_dict", "SeqWork", "StepBatch", "StepOutput", "DieFailure",
           "EmulatedRunner", "Engine", "PDConfig", "Results", "RequestResult", "Metrics", "BlockPool", "Scheduler",
           "pd_source_rank", "Request", "SamplingParams", "ExpertPipeline", "PipelineResult", "StreamSplit",
           "pipeline_reference", "decode_step_timing", "layer_timing", "DecodeStepTiming", "LayerTiming", "CoreSplit",
           "Deployment", "PRESETS", "resolve"]
