"""Small shared utilities. Public here: ``get_logger``, ``deep_getattr``, ``signature_info``,
``has_signature_parameter``, ``to_device``, ``clone_state_dict_to_cpu``, ``pad_sequence_to_length``,
``pad_and_stack_tensors``, ``selective_log_softmax``, ``align_logps_to_mask`` (upstream's names);
see also ``utils.framework.Torch`` (device queries), ``utils.fileio`` (atomic writes, locks) and
``utils.errors.UserError``."""

from twinkle.utils.introspection import deep_getattr, has_signature_parameter, signature_info
from twinkle.utils.logger import get_logger
from twinkle.utils.torch_utils import (
    clone_state_dict_to_cpu,
    pad_and_stack_tensors,
    pad_sequence_to_length,
    selective_log_softmax,
    to_device,
)
from twinkle.utils.transformers_utils import align_logps_to_mask

__all__ = [
    "get_logger",
    "deep_getattr",
    "signature_info",
    "has_signature_parameter",
    "to_device",
    "clone_state_dict_to_cpu",
    "pad_sequence_to_length",
    "pad_and_stack_tensors",
    "selective_log_softmax",
    "align_logps_to_mask",
]
