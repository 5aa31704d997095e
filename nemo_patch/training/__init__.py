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

"""The training side: when a run's checkpoints are consolidated, and where that plugs into NeMo and Lightning.

User settings (:mod:`.settings`, with the cadence in :mod:`.policy`), NeMo's strategy and checkpoint IO extended
(:mod:`.strategy`, :mod:`.checkpoint_io`, :mod:`.io_chain`), the Lightning callback that drives it (:mod:`.callback`),
the bookkeeping of finished saves (:mod:`.schedule`), the consolidation process queue (:mod:`.queue`) and the process
itself (:mod:`.worker`), and the run's ``LATEST`` pointer (:mod:`.latest`).

NeMo and Lightning are imported by ``strategy``, ``checkpoint_io``, ``io_chain`` and ``callback`` only; ``worker``
(the consolidation process) imports none of NeMo, Lightning or megatron-core. May import the engine and the export,
never the overlay, the CLI or ``nemo_patch.testing``. This ``__init__`` imports nothing.
"""
