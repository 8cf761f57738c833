"""The kernel cache is code the process runs: faults (no compiler, a damaged or partial build, two builders at once) and
folders another user could write. Each case runs in a fresh process with its own MIXEDPREC_CACHE, and looks at the
libraries that process really mapped (/proc/self/maps)."""
import json, os, shutil, subprocess, sys, threading
import pytest
import torch
from mixedprec import ops

PROBE = r'''
import json, os, re, sys, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    import torch
    from mixedprec import ops
    try: res = {'backend': ops.backend(torch.zeros(1)), 'error': None}; ops.scale_check_([torch.ones(2)], [torch.zeros(2)], 1.)
    except RuntimeError as e: res = {'backend': None, 'error': str(e)}
    if sys.argv[1:] == ['fp16']:                    # a front end, as a user would run it
        from mixedprec.fp16_optimizer import FP16_Optimizer
        m = torch.nn.Linear(2, 1).half()
        opt = FP16_Optimizer(torch.optim.SGD(m.parameters(), lr=0.1), verbose=False)
        opt.backward(m(torch.ones(1, 2).half()).float().sum()); opt.step()
res['warnings'] = [str(w.message) for w in caught]
# the kernel libraries (mixedprec_cpu*.so, mixedprec_cuda*.so) by name: the checkout's own path may hold 'mixedprec'
res['maps'] = sorted({l.split()[-1] for l in open('/proc/self/maps') if re.search(r'/mixedprec_[^/]*\.so', l)})
print('RESULT' + json.dumps(res))
'''

def probe(cache, *args, **env):
    ("Run the probe in a fresh process with `MIXEDPREC_CACHE=cache`; its result (backend, warnings, mapped mixedprec "
     "libraries) and stderr")
    e = {**os.environ, 'MIXEDPREC_CACHE': str(cache), **{k: str(v) for k, v in env.items()}}
    e.pop('MIXEDPREC_DISABLE_FUSED', None)
    p = subprocess.run([sys.executable, '-c', PROBE, *args], env=e, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, (p.returncode, p.stderr[-3000:])        # a damaged library must never kill the process
    line = next(l for l in p.stdout.splitlines() if l.startswith('RESULT'))
    return json.loads(line[len('RESULT'):]), p.stderr

def builds(cache):
    "The complete builds in `cache`: (key folder, library) pairs"
    res = []
    for root, dirs, files in os.walk(cache):
        res += [(root, os.path.join(root, f)) for f in files if f.endswith('.so') and os.path.exists(os.path.join(root, 'manifest.json'))]
    return res

@pytest.fixture(scope='module')
def good_build():
    "The default cache's build for this machine (built once if missing): its key folder"
    ext = ops.build_extension()
    # the one loaded (through a descriptor)
    mapped = {l.split()[-1] for l in open('/proc/self/maps') if l.rstrip().endswith(f'{ext.__name__}.so')}
    # not the newest: other sources' builds may be newer
    found = [root for root, so in builds(ops.default_cache()) if so in mapped]
    assert len(found) == 1, (found, mapped)
    return found[0]

def copy_build(good_build, cache):
    "A copy of a good build under `cache`, at the place this machine's build belongs; its library"
    rel = os.path.relpath(good_build, ops.default_cache())
    dst = os.path.join(cache, rel)
    shutil.copytree(good_build, dst)
    return next(os.path.join(dst, f) for f in os.listdir(dst) if f.endswith('.so'))

def loaded_from(res, folder): return [m for m in res['maps'] if m.startswith(str(folder))]

def test_two_processes_build_an_empty_cache_at_once_and_a_damaged_build_is_rebuilt(tmp_path):
    cache = tmp_path / 'cache'
    out = [None, None]
    def run(i): out[i] = probe(cache)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads: t.start()
    for t in threads: t.join()
    # the process that lost the race runs its own build, since removed
    for res, err in out:
        assert res[
            'backend'] == 'cpp' and res[
                'maps'] and all(m.startswith(str(cache)) or m == '(deleted)' for m in res['maps']), res
        assert 'compiling the fused kernels' in err
    assert any(loaded_from(res, cache) for res, _ in out)
    done = builds(cache)
    assert len(done) == 1                                           # one complete build; the other process's went away
    key, so = done[0]
    assert not [d for d in os.listdir(os.path.dirname(key)) if d.startswith('.building-')]
    assert oct(os.stat(key).st_mode & 0o777) == '0o700'
    # the library is truncated (a half-copied home folder): detected before it is loaded, rebuilt, with one message
    with open(so, 'r+b') as f: f.truncate(os.path.getsize(so) // 2)
    res, err = probe(cache)
    assert res['backend'] == 'cpp' and any('damaged' in w and 'rebuilding' in w for w in res['warnings']), res
    folder, lib = builds(cache)[0]
    fd = os.open(lib, os.O_RDONLY)
    try: assert ops._damaged(folder, lib, fd) is None
    finally: os.close(fd)
    # the next process loads the rebuilt library without compiling
    res, err = probe(cache)
    assert res['backend'] == 'cpp' and 'compiling' not in err and not res['warnings']

@pytest.mark.parametrize("size", [0, 'garbage'])
def test_a_damaged_library_is_never_loaded(good_build, tmp_path, size):
    so = copy_build(good_build, tmp_path)
    with open(so, 'wb') as f: f.write(b'' if size == 0 else b'\x7fELF not really' * 100)
    res, _ = probe(tmp_path, CXX='/bin/false')                      # no compiler: the rebuild fails, fast
    assert not loaded_from(res, tmp_path)
    assert any('damaged' in w for w in res['warnings']), res['warnings']
    assert res['backend'] == 'ref' and any('reference ops' in w and 'C++ compiler' in w for w in res['warnings'])

def test_a_partial_build_is_never_loaded(good_build, tmp_path):
    so = copy_build(good_build, tmp_path)
    os.remove(os.path.join(os.path.dirname(so), 'manifest.json'))  # a build that never finished recording itself
    partial = os.path.join(os.path.dirname(os.path.dirname(so)), '.building-crashed')
    shutil.copytree(os.path.dirname(so), partial)                  # and a build folder a crash left behind
    res, _ = probe(tmp_path, CXX='/bin/false')
    assert not loaded_from(res, tmp_path) and any('no record of a complete build' in w for w in res['warnings'])

def test_no_compiler_falls_back_with_a_warning_that_says_what_to_do(tmp_path):
    res, _ = probe(tmp_path / 'empty', 'fp16', CXX='/bin/false')
    assert res['backend'] == 'ref' and res['error'] is None
    said = [w for w in res['warnings'] if 'reference ops' in w]
    assert len(said) == 1 and 'install a C++ compiler' in said[0] and 'MIXEDPREC_CACHE' in said[0]
    res, _ = probe(tmp_path / 'empty', CXX='/bin/false', MIXEDPREC_REQUIRE_FUSED=1)
    assert 'MIXEDPREC_REQUIRE_FUSED' in res['error'] and 'install a C++ compiler' in res['error']

@pytest.mark.parametrize("fault", ['world-writable folder', 'another owner', 'library writable by others',
                                   'cannot be created'])
def test_an_unsafe_cache_is_refused_and_training_goes_on(good_build, tmp_path, fault):
    cache = tmp_path / 'cache'
    if fault == 'cannot be created':
        (tmp_path / 'a-file').write_text('')
        cache = tmp_path / 'a-file' / 'cache'
    else:
        so = copy_build(good_build, cache)
        if fault == 'world-writable folder': os.chmod(cache, 0o777)
        elif fault == 'library writable by others': os.chmod(so, 0o757)
        else:
            if os.getuid() != 0: pytest.skip("making a folder another user's needs root")
            for root, dirs, files in os.walk(cache):
                for n in [root] + [os.path.join(root, f) for f in files]: os.chown(n, 65534, 65534)
    res, _ = probe(cache)
    assert not loaded_from(res, cache), res['maps']
    # the kernels from the user's own cache
    assert res['backend'] == 'cpp' and loaded_from(res, ops.default_cache())
    said = [w for w in res['warnings'] if 'was not used' in w]
    assert len(said) == 1 and str(cache) in said[0] and 'MIXEDPREC_CACHE' in said[0], res['warnings']
    why = {'world-writable folder': 'writable by its group and others', 'another owner': 'owned by uid 65534',
           'library writable by others': 'writable by others', 'cannot be created': 'cannot be created'}[fault]
    assert why in said[0]

def test_unsafe_names_what_is_wrong(tmp_path):
    assert ops.unsafe(tmp_path) is None or 'writable' in ops.unsafe(tmp_path)
    os.chmod(tmp_path, 0o700); assert ops.unsafe(tmp_path) is None
    os.chmod(tmp_path, 0o770); assert 'writable by its group' in ops.unsafe(tmp_path)
    link = tmp_path.parent / (tmp_path.name + '-link')
    os.chmod(tmp_path, 0o700); os.symlink(tmp_path, link)
    assert ops.unsafe(link) is None
    os.remove(link)

def test_cpu_flags_are_read_once_and_the_file_closed(recwarn):
    import warnings, gc
    ops.cpu_flags.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter('error', ResourceWarning)
        a = ops.cpu_flags(); gc.collect()
    assert ops.cpu_flags() is a and ops.cpu_flags.cache_info().misses == 1

PLANTED = r'''
#include <stdio.h>
__attribute__((constructor)) static void planted(void) { FILE *f = fopen(MARKER, "w"); if (f) { fputs("ran", f); fclose(f); } }
'''

SWAP_BETWEEN_CHECK_AND_LOAD = r'''
import json, os, sys
from mixedprec import ops
planted = sys.argv[1]
real = ops._load_built
def swapping(name, so, *args):
    os.replace(planted, so)                 # another user swaps the library after the checks, before the load
    return real(name, so, *args)
ops._load_built = swapping
import torch
print('RESULT' + json.dumps({'backend': ops.backend(torch.zeros(1))}))
'''

def test_the_library_loaded_is_the_one_checked_even_if_swapped_in_between(good_build, tmp_path):
    # the check-then-load race: the library is checked and hashed through one open descriptor and loaded through it,
    # so a file put at the path between the check and the load never runs
    if shutil.which('gcc') is None: pytest.skip("no gcc to build the planted library")
    so = copy_build(good_build, tmp_path / 'cache')
    marker, src, planted = tmp_path / 'planted-ran', tmp_path / 'planted.c', tmp_path / 'planted.so'
    src.write_text(PLANTED)
    subprocess.run(['gcc', '-shared', '-fPIC', f'-DMARKER="{marker}"', '-o', str(planted), str(src)], check=True)
    e = {**os.environ, 'MIXEDPREC_CACHE': str(tmp_path / 'cache')}
    e.pop('MIXEDPREC_DISABLE_FUSED', None)
    p = subprocess.run([sys.executable, '-c', SWAP_BETWEEN_CHECK_AND_LOAD, str(planted)], env=e, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert not marker.exists(), "the planted library ran"
    assert '"backend": "cpp"' in p.stdout                             # the checked library was loaded and works

def test_a_folder_above_the_cache_that_others_can_write_is_refused(good_build, tmp_path):
    shared = tmp_path / 'shared'
    # not sticky: anyone may rename the cache inside it
    shared.mkdir(); os.chmod(shared, 0o777)
    cache = shared / 'cache'
    copy_build(good_build, cache)
    res, _ = probe(cache)
    assert not loaded_from(res, cache) and res['backend'] == 'cpp'
    said = [w for w in res['warnings'] if 'was not used' in w]
    assert len(
        said) == 1 and f'{shared}, a folder above the kernel cache, is writable by others' in said[0], res['warnings']
    os.chmod(shared, 0o1777)
    if os.getuid() == 0:                                               # root's and sticky, as /tmp: fine
        assert ops.unsafe_above(cache) is None

def test_stale_build_folders_are_removed_and_fresh_ones_kept(tmp_path):
    import time
    old, fresh = tmp_path / '.building-killed', tmp_path / '.building-running'
    for d in (old, fresh): d.mkdir(); (d / 'x.o').write_text('')
    t = time.time() - 2 * ops.STALE_BUILD_S
    os.utime(old, (t, t))
    ops._remove_stale_builds(tmp_path)
    assert not old.exists() and fresh.exists()

PRIVATE_BUILD = r'''
import os, shutil, sys, torch
import torch.utils.cpp_extension as cpp
from mixedprec import ops
good = sys.argv[1]
def fake_load(name, build_directory, **kw):               # the compiler's result, without minutes of compiling: the good build
    shutil.copy(good, os.path.join(build_directory, name + '.so'))
    return ops._load_built(name, os.path.join(build_directory, name + '.so'))
cpp.load = fake_load
print('BACKEND', ops.backend(torch.zeros(1)), 'PRIVATE', [d for d in os.listdir(os.environ['TMPDIR']) if d.startswith('mixedprec-')])
'''

def test_a_private_fallback_build_is_removed_at_exit(good_build, tmp_path):
    so = next(os.path.join(good_build, f) for f in os.listdir(good_build) if f.endswith('.so'))
    (tmp_path / 'home').write_text('')                                 # no cache folder can be made: HOME is a file
    (tmp_path / 'tmp').mkdir()
    e = {**os.environ, 'MIXEDPREC_CACHE': str(tmp_path / 'home' / 'cache'), 'HOME': str(tmp_path / 'home'),
         'TMPDIR': str(tmp_path / 'tmp')}
    e.pop('MIXEDPREC_DISABLE_FUSED', None)
    p = subprocess.run([sys.executable, '-c', PRIVATE_BUILD, so], env=e, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "BACKEND cpp PRIVATE ['mixedprec-" in p.stdout, p.stdout     # built privately while the process ran
    assert not [d for d in os.listdir(tmp_path / 'tmp') if d.startswith('mixedprec-')]   # and removed at its exit

# ---------------------------------------------------------------- as a user who is not root (the tests run as root
# here)

NOBODY = 65534

@pytest.fixture
def nobody_home(good_build):
    ("A folder of the unprivileged user `nobody` (outside root's private test folders), with its own default cache "
     "holding a good build; removed after")
    import tempfile
    if os.getuid() != 0 or shutil.which('setpriv') is None:
        pytest.skip("needs root and setpriv to run a probe as another user")
    base = tempfile.mkdtemp(prefix='mixedprec-nobody-', dir='/tmp')
    home = os.path.join(base, 'home')
    rel = os.path.relpath(good_build, ops.default_cache())
    shutil.copytree(good_build, os.path.join(home, '.cache', 'mixedprec', rel))
    for root, dirs, files in os.walk(base):
        for n in [root] + [os.path.join(root, f) for f in files]: os.chown(n, NOBODY, NOBODY)
    os.chmod(base, 0o755)
    yield base, home
    shutil.rmtree(base, ignore_errors=True)

def probe_as_nobody(cache, home):
    "The probe, run as `nobody` with `MIXEDPREC_CACHE=cache` and its own HOME"
    e = {**os.environ, 'MIXEDPREC_CACHE': str(cache), 'HOME': home}
    e.pop('MIXEDPREC_DISABLE_FUSED', None)
    p = subprocess.run(['setpriv', f'--reuid={NOBODY}', f'--regid={NOBODY}', '--clear-groups', sys.executable, '-c',
                        PROBE],
                       env=e, capture_output=True, text=True, timeout=600, cwd='/')
    if 'RESULT' not in p.stdout and ('Permission denied' in p.stderr or 'No module named' in p.stderr):
        pytest.skip("nobody cannot run this Python or read its packages here (a checkout or venv under a private "
                    "home, such as "
                    f"root's, mode 700): {p.stderr.strip()[-300:]}")
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(next(l for l in p.stdout.splitlines() if l.startswith('RESULT'))[len('RESULT'):])

def test_as_another_user_a_cache_root_owns_is_refused(good_build, nobody_home):
    base, home = nobody_home
    cache = os.path.join(base, 'roots-cache')                         # made by root: another user's, for nobody
    copy_build(good_build, cache)
    res = probe_as_nobody(cache, home)
    assert res['backend'] == 'cpp' and not loaded_from(res, cache) and loaded_from(res, home), res['maps']
    said = [w for w in res['warnings'] if 'was not used' in w]
    assert len(said) == 1 and f'is owned by uid 0, not by you (uid {NOBODY})' in said[0], res['warnings']

def test_as_another_user_a_read_only_cache_is_passed_over(nobody_home):
    base, home = nobody_home
    cache = os.path.join(base, 'read-only-cache')
    # nobody's own, but it cannot write there
    os.makedirs(cache); os.chown(cache, NOBODY, NOBODY); os.chmod(cache, 0o500)
    res = probe_as_nobody(cache, home)
    assert res['backend'] == 'cpp' and loaded_from(res, home), res['maps']
    said = [w for w in res['warnings'] if 'was not used' in w]
    assert len(
        said) == 1 and cache in said[
            0] and ('cannot be created' in said[0] or 'not writable' in said[0]), res['warnings']
