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

:mod:`.hook` is the import hook that ``nemo_patch.pth`` installs at interpreter start-up (standard library only, and
no other ``nemo_patch`` module); it applies the diffs as NeMo imports the files they edit. :mod:`.apply` connects it to
the package; :mod:`.version` refuses an unsupported NeMo before anything of NeMo's is imported; :mod:`.deprecated`
holds the spellings the overlay deprecates (upstream NeMo never had them). Nothing here goes upstream except the
diffs. May import the training side; nothing else imports this package but the package root. This ``__init__``
imports nothing.
"""
