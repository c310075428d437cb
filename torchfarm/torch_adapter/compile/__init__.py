"""Inductor's compile of a graph, and what the farm hooks into while it runs.

module               shims                                 used by
standalone           standalone_compile, save and load     compiler/inductor, workers/*, client
local_compile        compile_fx, Dynamo's fallback errors  client/graph (the farm cannot serve)
aoti_compile         aoti_compile_and_package              client/exported, compiler/aoti
aoti_weights_blob    AOTInductor's weight blob layout      compiler/aoti
autograd_cache_log   AOTAutograd's cache bypass log lines  compiler/inductor
autotune_progress    select_algorithm's autotuning logs    compiler/inductor, compiler/aoti
concurrent_backward  AOTAutograd's forward/backward steps  workers/compile_child (its helper)
gemm_benchmarks      algorithm selection's timings cache   workers/compile_child
tuning_devices       Inductor's autotuning process pool    compiler/inductor
cpp_libraries        CppCodeCache.load_async, its build    compiler/native, workers/kernel_*
light_wrapper        the output code's import lines        compiler/inductor
"""
