"""Loading a compiled artifact and running it as Inductor would have locally.

module              shims                                 used by
aoti_load           AOTInductor's package loader          compiler/aoti
load_prewarm        a fresh process's one-time load work  client/{backend,graph,switching}
cudagraphs_on_load  the post-compile cudagraphs step      compiler/inductor
triton_bundle       TritonBundler's load of the kernels   compiler/inductor
autotune_results    the loaded kernels' autotune cache    compiler/inductor, workers/kernel_cache
device_remap        the device index baked into outputs   compiler/serialize, compiler/inductor
extern_kernels      select_algorithm's extern_kernels     the loaded output code
graph_import        the load's import of graph lowering   compiler/inductor
debug_flags         Inductor's debug module's flags       compiler/inductor (the loaded calls)
decompositions      Inductor's decomposition picker       the loaded entry (compiler/inductor)
"""
