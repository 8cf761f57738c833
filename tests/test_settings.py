"""Settings under real conditions: `settings()` per thread, every MIXEDPREC_* variable checked when read, and front ends
that refuse kernels they cannot use before they change anything (a retry with other arguments works)."""
import os, subprocess, sys, threading
import pytest, torch
from torch import nn
from mixedprec import ops, amp
from mixedprec.engine import settings, set_defaults, current_decide
from mixedprec.fp16_optimizer import FP16_Optimizer
from helpers import synth_learner, mlp

# ---------------------------------------------------------------- settings() is per thread

def test_a_settings_block_in_one_thread_does_not_reach_another():
    inside, done, seen = threading.Event(), threading.Event(), {}
    def in_block():
        with settings(impl='ref', decide='never'):
            seen['inside'] = (ops.current_impl(), current_decide())
            inside.set(); done.wait(10)
    t = threading.Thread(target=in_block); t.start()
    inside.wait(10)
    seen['other'] = (ops.current_impl(), current_decide())        # this thread, while the other is inside its block
    done.set(); t.join()
    assert seen == {'inside': ('ref', 'never'), 'other': ('auto', 'cuda')}

def test_overlapping_blocks_in_two_threads_leave_the_defaults_as_they_were():
    # A enters, B enters, A leaves, B leaves: with process-wide globals the defaults ended at B's entry values
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    def a():
        with settings(impl='ref', decide='never'): a_in.set(); b_in.wait(10)
        a_out.set()
    def b():
        a_in.wait(10)
        with settings(impl='fused', decide='always'): b_in.set(); a_out.wait(10)
    ts = [threading.Thread(target=f) for f in (a, b)]
    for t in ts: t.start()
    for t in ts: t.join()
    assert (ops.current_impl(), current_decide(), ops.DEFAULT_IMPL) == ('auto', 'cuda', 'auto')

def test_a_fit_in_a_settings_block_runs_the_reference_while_another_thread_runs_the_kernels():
    # the model in the block steps with the reference ops; a step in another thread meanwhile picks the kernels (the
    # default)
    if ops.backend(torch.zeros(1)) == 'ref': pytest.skip("no fused kernels here")
    inside, done, seen = threading.Event(), threading.Event(), {}
    def in_block():
        with settings(impl='ref'):
            seen['inside'] = ops.backend(torch.zeros(1)); inside.set(); done.wait(10)
    t = threading.Thread(target=in_block); t.start(); inside.wait(10)
    seen['other'] = ops.backend(torch.zeros(1))
    done.set(); t.join()
    assert seen == {'inside': 'ref', 'other': 'cpp'}

def test_set_defaults_is_process_wide_and_blocks_still_win():
    try:
        set_defaults(decide='never')
        seen = {}
        t = threading.Thread(target=lambda: seen.setdefault('thread', current_decide())); t.start(); t.join()
        assert seen['thread'] == 'never'
        with settings(decide='always'): assert current_decide() == 'always'
        with pytest.raises(ValueError, match="decide must be"): set_defaults(decide='sometimes')
    finally: set_defaults(decide='cuda')

# ---------------------------------------------------------------- MIXEDPREC_* variables

@pytest.mark.parametrize("value,on", [('1', True), ('true', True), ('TRUE', True), ('yes', True), ('On', True),
                                      ('0', False), ('false', False), ('no', False), ('off', False), ('', False)])
def test_switches_take_the_usual_spellings(monkeypatch, value, on):
    monkeypatch.setenv('MIXEDPREC_REQUIRE_FUSED', value)
    assert ops.env_flag('MIXEDPREC_REQUIRE_FUSED') is on

def test_a_switch_with_another_value_is_refused_by_name(monkeypatch):
    monkeypatch.setenv('MIXEDPREC_DISABLE_FUSED', 'ture')
    with pytest.raises(ValueError, match=r"MIXEDPREC_DISABLE_FUSED='ture' is not a switch: set it to one of 1, true, "
                                         r"yes, on"):
        ops.env_flag('MIXEDPREC_DISABLE_FUSED')

def test_require_fused_true_is_honoured(monkeypatch):
    monkeypatch.setattr(ops, '_fused', lambda: (None, 'no compiler (a stand-in)'))
    monkeypatch.setenv('MIXEDPREC_REQUIRE_FUSED', 'true')
    with pytest.raises(RuntimeError, match='MIXEDPREC_REQUIRE_FUSED'):
        ops.scale_check_([torch.ones(2)], [torch.zeros(2)], 1.)

def test_disable_fused_true_turns_the_kernels_off_in_a_fresh_process():
    code = "import torch; from mixedprec import ops; print('BACKEND', ops.backend(torch.zeros(1)))"
    p = subprocess.run([sys.executable, '-c', code], env={**os.environ, 'MIXEDPREC_DISABLE_FUSED': 'true'},
                       capture_output=True, text=True, timeout=300)
    assert 'BACKEND ref' in p.stdout, p.stderr[-2000:]

AVX2_ONLY = frozenset({'sse4_2', 'avx', 'avx2', 'fma', 'f16c'})

def test_an_isa_the_cpu_lacks_is_refused_naming_what_is_missing(monkeypatch):
    monkeypatch.setenv('MIXEDPREC_ISA', 'avx512')
    with pytest.raises(ValueError, match=r"MIXEDPREC_ISA='avx512', but this CPU lacks avx512bw, avx512dq, avx512f, "
                                         r"avx512vl \(it has avx, avx2, f16c, fma\)"):
        ops.cpu_isa(AVX2_ONLY)
    monkeypatch.setenv('MIXEDPREC_ISA', 'avx2')
    assert ops.cpu_isa(AVX2_ONLY)[0] == 'avx2'
    monkeypatch.setenv('MIXEDPREC_ISA', 'portable')
    assert ops.cpu_isa(AVX2_ONLY) == ('', [])

def test_a_misspelt_isa_is_refused_not_built_portable(monkeypatch):
    monkeypatch.setenv('MIXEDPREC_ISA', 'avx-512')
    with pytest.raises(ValueError, match=r"MIXEDPREC_ISA='avx-512' is not one of avx512, avx2, portable"):
        ops.cpu_isa(AVX2_ONLY)

def test_a_bad_isa_setting_is_an_error_in_a_fresh_process_not_a_quiet_fallback(tmp_path):
    code = ("import torch; from mixedprec import ops\n"
            "try: ops.scale_check_([torch.ones(2)], [torch.zeros(2)], 1.); print('RAN')\n"
            "except ValueError as e: print('REFUSED', e)")
    p = subprocess.run([sys.executable, '-c', code], env={**os.environ, 'MIXEDPREC_ISA': 'avx-512',
                                                          'MIXEDPREC_CACHE': str(tmp_path)},
                       capture_output=True, text=True, timeout=300)
    assert "REFUSED MIXEDPREC_ISA='avx-512'" in p.stdout, (p.stdout, p.stderr[-2000:])
    # nothing was built, nothing left behind
    assert not list(tmp_path.rglob('*.so')) and not list(tmp_path.rglob('.building-*'))

# ---------------------------------------------------------------- set-up is all or nothing

@pytest.fixture
def no_kernels(monkeypatch):
    "The fused kernels cannot be built here (as with no compiler)"
    monkeypatch.setattr(ops, '_fused', lambda: (None, 'no C++ compiler (a stand-in)'))

def test_to_fp16_fused_without_kernels_changes_nothing_and_a_retry_works(no_kernels):
    learn = synth_learner(mlp())
    learn.create_opt()
    opt, dtypes = learn.opt, [p.dtype for p in learn.model.parameters()]
    with pytest.raises(RuntimeError, match="impl='fused'.*no C\\+\\+ compiler"): learn.to_fp16(impl='fused')
    assert [p.dtype for p in learn.model.parameters()] == dtypes and learn.opt is opt
    assert not hasattr(learn, 'mixed_precision')
    learn.to_fp16()                                                    # the retry with the default trains
    learn.fit(1)

def test_amp_initialize_fused_without_kernels_changes_nothing_and_a_retry_works(no_kernels):
    model = mlp(); opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="impl='fused'"):
        amp.initialize(model, opt, opt_level='O2', impl='fused', verbosity=0)
    assert all(p.dtype == torch.float32 for p in model.parameters()) and not hasattr(opt, '_mixedprec_engine')
    model, opt = amp.initialize(model, opt, opt_level='O2', verbosity=0)   # not "already passed to amp.initialize"
    with amp.scale_loss(model(torch.randn(8, 8)).float().pow(2).mean(), opt) as s: s.backward()
    opt.step()

def test_fp16_optimizer_fused_without_kernels_leaves_the_optimizer_as_it_was(no_kernels):
    model = mlp().half(); inner = torch.optim.SGD(model.parameters(), lr=0.1)
    params = [p for g in inner.param_groups for p in g['params']]
    with pytest.raises(RuntimeError, match="impl='fused'"): FP16_Optimizer(inner, impl='fused', verbose=False)
    assert [p for g in inner.param_groups for p in g['params']] == params   # the half params, not swapped masters
    FP16_Optimizer(inner, verbose=False)

# ---------------------------------------------------------------- what a user sees of the build and of warnings

def test_a_warning_points_at_the_users_line():
    import warnings
    from mixedprec.convert import convert_model
    ops._warned.clear()
    model = nn.Sequential(nn.Linear(4, 4))
    with torch.no_grad(): model[0].weight[0, 0] = 1e6               # beyond fp16's range: converting warns
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        convert_model(model)
    ours = [w for w in caught if 'mixedprec' in str(w.message)]
    assert ours and all(w.filename == __file__ for w in ours), [(w.filename, w.lineno) for w in ours]

def test_a_compile_says_every_few_seconds_how_long_it_has_run(monkeypatch, capsys):
    import time
    monkeypatch.setattr(ops, 'PROGRESS_EVERY_S', 0.05)
    with ops._progress('compiling the fused kernels'): time.sleep(0.3)
    said = capsys.readouterr().err
    assert said.count('mixedprec: compiling the fused kernels: 0 s so far (once per machine)') >= 3

def test_no_cuda_message_on_a_machine_without_a_gpu():
    if torch.cuda.is_available() or ops.find_cuda_home() is None: pytest.skip("needs a CUDA toolkit and no GPU")
    env = {**os.environ, 'CUDA_HOME': ops.find_cuda_home()}
    plain = subprocess.run([sys.executable, '-c', 'import torch.utils.cpp_extension'], env=env, capture_output=True,
                           text=True, timeout=300)
    assert 'No CUDA runtime is found' in plain.stderr                  # torch's own import says it
    ours = subprocess.run([sys.executable, '-c', 'from mixedprec import ops; ops._cpp_extension()'], env=env,
                          capture_output=True, text=True, timeout=300)
    assert ours.returncode == 0 and 'No CUDA runtime' not in ours.stderr, ours.stderr
