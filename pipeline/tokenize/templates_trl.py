"""TRL's training chat templates: the templates TRL 1.16's SFTTrainer knows, each with the version it
renders with under `assistant_only_loss: true` (prefix-preserving, the assistant's turns in
`{% generation %}` blocks). `training_version` chooses as TRL's `get_training_chat_template` does:
a template without generation blocks that equals one of TRL's originals exactly.

The files are in `trl_templates/` beside this module, as TRL ships them; `PAIRS` pins their SHA-256
(tests/e2e/test_trl_training_templates.py compares them with an installed TRL's).
"""

# Copyright 2020-2026 The HuggingFace Team; licensed under the Apache License, Version 2.0
# (trl_templates/LICENSE, https://www.apache.org/licenses/LICENSE-2.0): TRL 1.16.0 (PyPI wheel
# trl-1.16.0-py3-none-any.whl), trl/chat_templates/<name>.jinja and <name>_training.jinja, each
# copied unchanged.

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path
from typing import Any

from pipeline.errors import UserError
from pipeline.tokenize.chat_turns import GENERATION

FOLDER = Path(__file__).with_name("trl_templates")

# name: (SHA-256 of <name>.jinja, SHA-256 of <name>_training.jinja), the files' bytes
PAIRS: dict[str, tuple[str, str]] = {
    "cohere": (
        "90c33aee14aa2a226127516d48ee9184c9b90745d4a04c484621ec2e82fb712c",
        "5f9718bfe3a1945366ea792b9714e42aa5849f1d41a1093c2ce4da4a77383996",
    ),
    "cohere2": (
        "2147c474f41b522b7296f74692b9f31e45f49a31465960576a9d321339c5915a",
        "7e5836a74c01d22504306273f8a7b49f944f6b960efee67609c07eef0a9ba295",
    ),
    "deepseek_r1_distill": (
        "56a1447ad31926fdc21fb07e56e5642bd9c850c4f52d8c8af7bbe5f079a84f5f",
        "439ca50e037bdf26b9e654e3eaa559fdd19d41e602307bcb133451070eb2ee3e",
    ),
    "deepseekv3": (
        "563b1ce7d61d50a9b4c7439a912a1116f095b712df5b5e4d3e1116049874eb64",
        "aadb4942004c186f9ba97d28f653d7f2e0dc20e4275352a486f7cafbe4dd7b51",
    ),
    "diffusion_gemma": (
        "9aeb7eac68ad87bba7567e9d4597ff203e5609f1b427d9e823437d0142cc61bf",
        "cf1664f301605c2fa7e361a18b5b60aaf3896b3f8e2626b96869a99c8e8a71f9",
    ),
    "gemma": (
        "ecd6ae513fe103f0eb62e8ab5bfa8d0fe45c1074fa398b089c93a7e70c15cfd6",
        "f825de9ae80eac8a89fa5f9e6e80adf7b79ab8602564907e7c41dc15315d04ab",
    ),
    "gemma3": (
        "7de1c58e208eda46e9c7f86397df37ec49883aeece39fb961e0a6b24088dd3c4",
        "959b257e7fc1603f8cae9c9890e62f43d6ded6c0f72b9b73c4106a4ceaa096fc",
    ),
    "glm4moe": (
        "44f815868bf02fa458dd2f741a338046f4bf45f398eb6d067766726b9d96cce3",
        "79c2386fbe44c9881be09b2dd086e0799b15447f8d530c45041152b6da9f3704",
    ),
    "gptoss": (
        "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146",
        "6adda7cea0f63ef14918be7f26100b324525b6185a8f06932914388ffaa52e32",
    ),
    "idefics3": (
        "0d7e56ca41705b79932de707b22bc855c3cfcefae62f1ac5e458560654883d2e",
        "b3d230222aae242eeda373f36f08c7170557dcbd4a93dfb2d2d3c718ee777654",
    ),
    "lfm2": (
        "cef187400d62a59507aab3a642ea9a8d2a2ef263562bc3430560e116945273cf",
        "fc29163f52185634af234b57c358b231f22e9a266f8ecba90627e47a03626103",
    ),
    "lfm2_v2": (
        "5504d163d879bfb6fd4135b7fa3d56768b2e69dd718338f7b146750289f46ab0",
        "fd9c5f7cb11511f72c3db43496380e4b40e7a6110a978dc27cf338ddec45efb2",
    ),
    "llama3": (
        "ba03a121d097859c7b5b9cd03af99aafe95275210d2876f642ad9929a150f122",
        "9dce981e2954cf77d4d0ad2dbacf8006a5fda34a0bdf4923075a933d08b69470",
    ),
    "llava_next": (
        "2c17243a977fd0643fb549a509a8e2684f45517df0f9f608d5893b719f16569f",
        "27c0b73c5de0a0f5561d748d53d2cdab4788bb83887d33cbc74bdf2a8d148bf1",
    ),
    "muse_glimmer": (
        "cfc67e5f349f37690dfd31ed1f18bc4442a9dd32fe39a648f993cb4eb3cae678",
        "6eec84ccc527ef03efdcad19e64e5a4347d22c13c5d80fadcaf289ca3457ced9",
    ),
    "nemotron_3_5_lightning": (
        "58933db77d3099b4f78c55a38347a72e1ea05b97d6bd8f38775303dc0194e0a9",
        "a44efc49cf02e3dee4421bd34925ba7e2081f1652b16648efbec4a6e8a203ea8",
    ),
    "nemotron_3_nano": (
        "ab7813c3abdd9cb655905a410728b26c7884eca45ddfab8d9f931553485a7862",
        "f52a4a70292b98db4d1b9f69a59546a43fc5e8603a6794781973a3e5821bd475",
    ),
    "nemotron_3_super": (
        "575fb74f54ed264df9047d0ecce3c98938aae953fb4f50356675706264cbb68a",
        "d3859585444574090259d403ca65f71a496b77b0b50f31106aa99a25f5caa692",
    ),
    "nemotron_3_ultra": (
        "82753bef5cedc4932c1ed509b5c9a12be680fd86d1adb65bc3f7398d11c8eebc",
        "d61cca230ac4f8137e74e88d73d8a649e4c3a71bb79b82925a19cf6dc52a6c7e",
    ),
    "phi3": (
        "dcaee66df77bfbb789ec541fe713218da30225a526f1db97138fc39ee6dc56aa",
        "f00b774c5933129ee0a72bed355d9947cb09f8063d6cf23b7db71b33b5ea2162",
    ),
    "phi3_5": (
        "78d976a442bcde2f0be15aafbb8e3050e1104f86732266f68403251b89982a90",
        "a76a9651a9785afe269c6b91598d55f03ab8adf3d8489a4a9c8ef432128b7c08",
    ),
    "qwen2_5": (
        "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f",
        "0cd86fb80f520885e35040a8df321540e729d3358da41f27cf74d33103d94f62",
    ),
    "qwen2_5_vl": (
        "a0bc6f6fc7a29a80017a433e8f03a1cc1236e838a944a2d034295a60c4f2fddb",
        "31c85932a6d8826f0fe8d52b81767eba6b869128b0a7c7503d1e7baaad4e8043",
    ),
    "qwen3": (
        "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8",
        "1d944ff8f268b611abb296cdd24d0f51981eef1c8647ac321c3a0258f61eb6c9",
    ),
    "qwen3_5_nothink": (
        "273d8e0e683b885071fb17e08d71e5f2a5ddfb5309756181681de4f5a1822d80",
        "f32fe3e21c20f59d193244181c8b4c324c73a8cd313ddf825633a9ecfd2afad2",
    ),
    "qwen3_5_think": (
        "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715",
        "ccf356d8f238e287c047b1ef589850fd6b2b44e6cb29079e26c635fb9b8111ef",
    ),
    "qwen3_6": (
        "e84f32a23fdda27689f868aa4a1a5621f41133e51a48d7f3efcbea2839574259",
        "c5a26eaf3aab77fdc4ec696540ff896713ff0764f552ce9f597ede99fc673034",
    ),
    "qwen3_8": (
        "c3cf9e34abf4f9e36c2d72165aa9c132d3e2a725b6c2586aaa3a8af9d7a81041",
        "320c2f734288f91c341c1c3c9690e4e6aba07a27852bf88d7c8481c880168288",
    ),
    "qwen3_instruct_2507": (
        "64f85b198065d0fba2a81f37e10ed68161ce2c19a754c7100e67e0ca2ee9c326",
        "48e17aa3caf5bf20075b6e7366864ee943e00b6f0752aadfe8b670c2ab0291a5",
    ),
    "qwen3_vl": (
        "3636d0f0bd6bef02654cdffdc447b79cb2cef8ab02cc75267345946291a489e4",
        "66bd81986bf7f8abe6d7fb4a50341c8d8ae14b16637e8fb876bca7e7ef0b9c6f",
    ),
    "smolvlm": (
        "830005085ddd94cec605b6e21b885b28ffad6e3f82ee6a212c523533e8f04f01",
        "7bdde450db307d860832daa767452614e93297f1520a969bcdea2e11460ca893",
    ),
}


def training_version(template: Any) -> tuple[str, str] | None:
    """(name, text) of TRL's training template for `template` (its `default` variant if a dict):
    when it has no `{% generation %}` blocks and equals TRL's original `name` exactly; else None
    (a template TRL does not know, or one that needs no patching, is used as it is)."""
    text = template.get("default") if isinstance(template, dict) else template
    if not isinstance(text, str) or GENERATION.search(text):  # TRL's has_generation_markers
        return None
    for name in PAIRS:
        if text == _read(name):
            return name, _read(f"{name}_training")
    return None


@cache
def _read(stem: str) -> str:
    """A vendored file's text, read as TRL reads it (UTF-8, universal newlines), after checking its
    bytes against the pinned SHA-256."""
    training = stem.endswith("_training")
    path = FOLDER / f"{stem}.jinja"
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UserError(f"{path}: cannot read TRL's template ({exc}): reinstall packlm") from None
    if hashlib.sha256(data).hexdigest() != PAIRS[stem.removesuffix("_training")][int(training)]:
        raise UserError(f"{path}: not the file TRL 1.16 ships (its SHA-256 differs): reinstall packlm")
    return data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")  # Path.read_text's newlines
