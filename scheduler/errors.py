from berth.errors import InvalidInput


class InvalidNodeReport(InvalidInput):
    code = "invalid_node_report"
