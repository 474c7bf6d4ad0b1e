"""Triton adapter for engine.detokenize: token windows in, UTF-8 text pieces out."""

from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from adapters.triton_common import error_response, model_parameters
from engine.detokenize import TokenDecoder


class TritonPythonModel:
    def initialize(self, args):
        self.decoder = TokenDecoder.from_model_dir(Path(model_parameters(args)["model_dir"]))

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                ids = pb_utils.get_input_tensor_by_name(request, "token_ids").as_numpy().reshape(-1).tolist()
                offset = int(
                    pb_utils.get_input_tensor_by_name(request, "read_offset").as_numpy().reshape(-1)[0]
                )
                final = bool(pb_utils.get_input_tensor_by_name(request, "is_final").as_numpy().reshape(-1)[0])
                piece = self.decoder.delta(ids, offset, final)
                out = np.array([piece], dtype=np.object_)
                responses.append(
                    pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("text_output", out)])
                )
            except Exception as exc:
                responses.append(error_response(exc))
        return responses
