"""No private hook of a library can break every command (issue 34, item 7): cli/main.py's patch of typer's help
labels is feature-detected, and click's NoArgsIsHelpError (click >= 8.2 only) is looked up, never assumed. The real
older typer is run by .ci/run's floor step (.ci/floors.sh); these tests pin the fallbacks' logic."""

from __future__ import annotations

from decodelab.cli import main as cli_main


class OldOption:
    """An option class from a typer without ``display_type_rich`` (older than 0.12)."""

    is_flag = True


def test_a_typer_without_the_hook_is_left_alone():
    assert cli_main.flags_take_no_value(OldOption) is False
    assert not hasattr(OldOption, "display_type_rich")


def test_a_typer_with_the_hook_gets_flags_without_a_type_label():
    class NewOption:
        is_flag = False
        count = False

        def display_type_rich(self, ctx):
            return "<int>"

    assert cli_main.flags_take_no_value(NewOption) is True
    option = NewOption()
    assert option.display_type_rich(None) == "<int>"
    option.is_flag = True
    assert option.display_type_rich(None) is None
    patched = NewOption.display_type_rich
    assert cli_main.flags_take_no_value(NewOption) is True  # a second call does not wrap the wrapper
    assert NewOption.display_type_rich is patched


def test_the_installed_typer_is_patched_where_it_has_the_hook():
    import typer.core

    has_hook = callable(getattr(typer.core.TyperOption, "display_type_rich", None))  # typer 0.29 has it, 0.16 not
    assert cli_main.flags_take_no_value() is has_hook
    assert getattr(getattr(typer.core.TyperOption, "display_type_rich", None), "flags_take_no_value", False) \
        is has_hook


def test_no_args_is_help_is_looked_up_not_assumed():
    assert cli_main.NO_ARGS_IS_HELP == getattr(cli_main.cli_errors, "NoArgsIsHelpError", ())
    try:  # an empty tuple catches nothing, and raises nothing on an older click
        raise ValueError
    except ():
        raise AssertionError("an empty tuple caught an exception")
    except ValueError:
        pass


def test_no_arguments_print_the_help_and_exit_0(capsys):
    assert cli_main.main([]) == 0
    assert "sample" in capsys.readouterr().out
