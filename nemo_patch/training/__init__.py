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

"""The training side: when a run's checkpoints are consolidated, and what NeMo's edited classes call.

The knob: the settings (:mod:`.config`, :mod:`.settings`, the cadence in :mod:`.policy`), what NeMo's
``MegatronStrategy``, ``MegatronCheckpointIO`` and ``ModelCheckpoint`` call (:mod:`.integration`), the Lightning
callback (:mod:`.callback`), the run's coordinator (:mod:`.coordinator`, the saves in :mod:`.schedule`), the
consolidation process (:mod:`.queue`, :mod:`.worker`) and the end of ``fit`` on every rank (:mod:`.fit_end`). The later
additions, each reached only through an optional import or the coordinator's observers: outputs kept past NeMo's
removals and ``LATEST`` (:mod:`.retention`, :mod:`.latest`), the ``"best"`` cadence and ``BEST`` (:mod:`.best`),
cadence phases (:mod:`.phases`), the journal of due consolidations (:mod:`.journal`), the post command and the
callbacks' hooks (:mod:`.hooks`), and the training metrics (:mod:`.metrics`).

NeMo is imported by ``integration`` only, inside its functions; the consolidation process (``worker``) imports none of
NeMo, Lightning or megatron-core. May import the engine and the export, nothing else of this package's parent. This
``__init__`` imports nothing.
"""
