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

"""The overlay: NeMo's own modules run with the edits that go upstream (``nemo_edits/*.diff``) applied to their source.

:mod:`.hook` is the start-up import hook (standard library only), :mod:`.apply` connects it to the package,
:mod:`.version` refuses an unsupported NeMo, :mod:`.deprecated` holds the deprecated spellings. Nothing here goes
upstream except the diffs. This ``__init__`` imports nothing.
"""
