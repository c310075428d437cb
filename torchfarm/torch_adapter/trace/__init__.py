"""The graph as Dynamo traced it, and as it travels: Dynamo, fake tensors, ShapeEnv, export.

module           shims                                 used by
dynamo_package   Dynamo's CompilePackage and guards    client/decorator, client/packages
identity         Dynamo's ID_MATCH, CLOSURE_MATCH      trace/dynamo_package
script_functions Dynamo's GuardsStatePickler, Guard    trace/dynamo_package
named_backend    OptimizeContext.__call__ (wrapped)    client/entry (torch.compile's skip)
guard_text       ShapeEnv's guard text, SymInt hints   client/*, compiler/guards
deferrable       Dynamo's ShapeEnv, fake-tensor errors client/backend, client/prepare
operators        torch._ops.OpOverload(Packet)         trace/identity, compiler/structure
fake_tensors     FakeTensorMode, TracingContext        client/prepare, compiler/*, workers/canary
fake_device      fake tensors on an absent device      client/prepare
fake_ranks       a process group that sends nothing    client/prepare
graph_pickler    torch.fx._graph_pickler               compiler/serialize
shape_env        the ShapeEnv fields a payload keeps   compiler/serialize, compiler/inductor
static_inputs    AOTAutograd's static input marks      compiler/inductor
export_serde     torch.export's JSON serde             client/exported, compiler/exported
"""
