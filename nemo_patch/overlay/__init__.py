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

"""The overlay: makes an installed NeMo's ``MegatronStrategy`` name refer to :class:`nemo_patch.MegatronStrategy`.

:mod:`.hook` is the import hook that ``nemo_patch.pth`` installs at interpreter start-up (standard library only, and
no other ``nemo_patch`` module); :mod:`.apply` replaces the public names once NeMo's strategy module has been
executed; :mod:`.version` refuses an unsupported NeMo before anything of NeMo's is imported. Nothing here goes
upstream. May import the training side (the class it installs); nothing else imports this package but the
package root. This ``__init__`` imports nothing.
"""
