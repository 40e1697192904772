"""The README's set-up commands are the ones CI runs."""

from conftest import REPO


def test_ci_runs_exactly_the_readme_test_command():
    readme = (REPO / "README.md").read_text().splitlines()
    commands = [line.strip() for line in readme[:9] if line.startswith("    ")]
    assert len(commands) == 2, "the README starts with its two set-up commands"
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line and not line.startswith(("#", "set ", "cd "))]
    assert ci == [commands[1]]
    assert "bsrun -np 2 python examples/train_ddp.py" in commands[0]
