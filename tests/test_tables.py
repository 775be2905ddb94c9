"""Declared tables: one line per record, absent values shown as absent, empty columns hidden."""

from types import SimpleNamespace

from berth.tables import Column, Table


class PeopleTable(Table):
    columns = (
        Column("Name", "name", link=lambda row: f"/people/{row.name}/"),
        Column("Nickname", "nickname"),
        Column("GPUs", "gpus", numeric=True),
    )


def test_column_empty_on_every_row_is_hidden():
    table = PeopleTable([SimpleNamespace(name="ada", nickname=None, gpus=2),
                         SimpleNamespace(name="bob", nickname="", gpus=None)])
    assert [c.header for c in table.visible_columns] == ["Name", "GPUs"]
    assert [cell.text for cell in table.lines[1]] == ["bob", "—"]
    assert table.lines[1][1].absent and not table.lines[0][1].absent
    assert table.lines[0][0].href == "/people/ada/"


def test_zero_is_a_value_not_an_absence():
    table = PeopleTable([SimpleNamespace(name="ada", nickname="a", gpus=0)])
    assert table.lines[0][2].text == "0" and not table.lines[0][2].absent


def test_empty_table_keeps_its_headers_and_says_why():
    table = PeopleTable([], empty_message="Nobody yet.")
    assert len(table.visible_columns) == 3
    assert table.empty_message == "Nobody yet."


class SizedTable(Table):
    columns = (
        Column("Name", "name"),
        Column("Size", lambda row: f"{row.size} bytes" if row.size else None, numeric=True, sort="size"),
        Column("GPUs", "gpus", numeric=True),
        Column("Actions", lambda row: "Deploy", sort=False),
    )


def test_a_cell_sorts_by_its_raw_figure_where_its_text_would_sort_wrongly():
    table = SizedTable([SimpleNamespace(name="a", size=900, gpus=2), SimpleNamespace(name="b", size=None, gpus=None)])
    name, size, gpus, actions = table.lines[0]
    assert (name.sort, size.sort, gpus.sort, actions.sort) == ("", "900", "2", "")  # the text "a" sorts as it is
    assert table.lines[1][1].sort == "" and table.lines[1][1].absent  # absent: sorted last by the browser
    assert [c.sortable for c in table.visible_columns] == [True, True, True, False]
