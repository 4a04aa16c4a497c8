"""Compiled code is cached under the job's dump folder (a restarted job loads it) unless the user
chose a folder; the generator reports the seconds it spent compiling."""

import os

from titanrl.components import compile_cache


def test_compile_cache_lives_under_the_dump_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_cache, "_USER_CACHE_DIR", None)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/inductor/defaulted/to")
    folder = compile_cache.use_compile_cache(str(tmp_path))
    assert folder == os.path.join(str(tmp_path), "compile_cache") == os.environ["TORCHINDUCTOR_CACHE_DIR"]


def test_a_cache_folder_the_user_chose_is_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_cache, "_USER_CACHE_DIR", "/mine")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/mine")
    assert compile_cache.use_compile_cache(str(tmp_path)) == "/mine" == os.environ["TORCHINDUCTOR_CACHE_DIR"]


def test_compile_seconds_grow_with_each_compile():
    import torch

    before = compile_cache.compile_seconds()
    torch.compile(lambda x: x * 3 + 1, backend="eager")(torch.ones(3))
    assert compile_cache.compile_seconds() > before
