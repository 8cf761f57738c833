import pytest
from mixedprec.demo import train, summary

def test_fp16_digits_matches_fp32_within_one_point():
    acc = {p: train(p, epochs=8, show=False).recorder.values[-1][2] for p in ('fp32', 'fp16')}
    assert acc['fp16'] >= 0.95
    assert abs(acc['fp16'] - acc['fp32']) <= 0.01, acc

def test_summary_says_what_ran():
    s = summary(train('fp16', epochs=1, show=False))
    for line in ('Linear float16', 'BatchNorm1d float32', 'masters:       float32', 'loss scale:', 'skipped steps:',
                 'implementation: cpp'):
        assert line in s, s

@pytest.mark.parametrize("compiled", [False, True])
def test_the_time_line_says_whether_the_kernels_were_compiled_or_loaded(compiled, monkeypatch, capsys):
    "Said from what the kernel loader did in this process, not guessed from how long it took"
    from mixedprec import ops
    from mixedprec.demo import main
    monkeypatch.setattr(ops, '_said_compiling', {'a cache folder'} if compiled else set())
    main(precision='bf16', epochs=1)
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith('time:'))
    assert (' compiled in ' if compiled else ' loaded in ') in line, line
