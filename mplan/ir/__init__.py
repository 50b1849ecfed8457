"""Graph capture and the typed IR: `capture(model, inputs) -> Graph`; pipeline schedules as data.

The IR knows nothing of planning: it records what the model computes (ops, shapes, FLOPs,
bytes, parameters, saved activations, repeated blocks) and what a pipeline schedule does.
"""
from mplan.ir.capture import CaptureError, capture
from mplan.ir.graph import BlockType, Graph, OpNode, ParamInfo, Segment, TensorMeta, dtype_bytes

__all__ = ["BlockType", "CaptureError", "Graph", "OpNode", "ParamInfo", "Segment", "TensorMeta",
           "capture", "dtype_bytes"]
