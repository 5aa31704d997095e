# Copyright (c) 2026, NVIDIA CORPORATION.  All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

"""The consolidation engine: a finished NeMo 2 ``torch_dist`` distributed checkpoint in, unsharded safetensors out.

Reading the DCP metadata and shards (:mod:`.dcp_metadata`, :mod:`.dcp_reader`), finding and checking a checkpoint on
disk (:mod:`.checkpoint_layout`), naming and planning the output tensors (:mod:`.plan`, :mod:`.output_layout`),
writing safetensors (:mod:`.safetensors_writer`), publishing atomically (:mod:`.publish`), the whole consolidation
(:mod:`.consolidate`), checking it (:mod:`.verify`), reading an output's single file or shards through their index
(:mod:`.output_files`), loading it back (:mod:`.load`) and the errors (:mod:`.errors`).

Imports the standard library, torch and safetensors only: never NeMo, Lightning or megatron-core, and nothing from
the training side, the overlay, the export or the CLI (the import-linter contracts in ``setup.cfg``). This
``__init__`` imports nothing, so that the torch-free modules (``errors``, ``checkpoint_layout``, ``output_layout``) can
be used without importing torch.
"""
