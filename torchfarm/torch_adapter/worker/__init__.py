"""What only the worker's processes use: their toolchain, the pool's kernel builds, the GPU.

module               shims                                 used by
precompiled_headers  Inductor's precompiled C++ header     workers/toolchain, workers/sandbox
isa_probe            Inductor's CPU vector-ISA probe       workers/isa_verdict, compile_child
compile_workers      Inductor's compile worker pool        workers/compile_child
gpu_benchmark_lock   Inductor's GPU benchmark hook         workers/gpu_lock (the lock it holds)
triton_cache         Triton's cache manager                workers/compile_child
triton_kernels       AsyncCompile.triton, a kernel build   workers/kernel_cache, kernel_builder
triton_source_check  Inductor's Triton kernel template     worker/triton_kernels
gemm_problems        Inductor's GEMM timings cache         workers/{compile_child,kernel_*,gemm_*}
"""
