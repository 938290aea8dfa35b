"""Platform inputs built with the platforms' own SDKs, for tests/api/platforms/sdk_inputs.rs:
a Telegram update built from python-telegram-bot's objects (as a bot framework sees it) and
a WeCom callback encrypted and signed by wechatpy's enterprise crypto (the WXBizMsgCrypt
scheme). Reads a JSON spec on stdin, prints JSON on stdout."""

import datetime
import json
import sys
import xml.etree.ElementTree as ET


def telegram(spec):
    from telegram import Chat, Message, MessageEntity, Update, User

    date = datetime.datetime.fromtimestamp(1_700_000_000, tz=datetime.timezone.utc)
    chat = Chat(id=spec["chat_id"], type=spec["chat_type"], is_forum=spec.get("forum"))
    sender = User(id=spec["from_id"], is_bot=False, first_name="Ada", username="ada")
    bot = User(id=7, is_bot=True, first_name="Helper", username=spec["bot"])
    text = spec["text"]
    entities = []
    mention = "@" + spec["bot"]
    if mention in text:
        entities.append(
            MessageEntity(type=MessageEntity.MENTION, offset=text.index(mention), length=len(mention))
        )
    reply_to = None
    if spec.get("reply_to_bot"):
        reply_to = Message(message_id=99, date=date, chat=chat, from_user=bot, text="The canteen opens at 8.")
    message = Message(
        message_id=spec["message_id"],
        date=date,
        chat=chat,
        from_user=sender,
        text=text,
        entities=entities or None,
        message_thread_id=spec.get("topic"),
        is_topic_message=True if spec.get("topic") else None,
        reply_to_message=reply_to,
    )
    return Update(update_id=spec["update_id"], message=message).to_dict()


def wecom(spec):
    from wechatpy.enterprise.crypto import WeChatCrypto

    crypto = WeChatCrypto(spec["token"], spec["aes_key"], spec["corp_id"])
    sealed = ET.fromstring(crypto.encrypt_message(spec["xml"], spec["nonce"], spec["timestamp"]))
    return {
        "encrypt": sealed.findtext("Encrypt"),
        "signature": sealed.findtext("MsgSignature"),
    }


if __name__ == "__main__":
    request = json.load(sys.stdin)
    build = {"telegram": telegram, "wecom": wecom}[request["platform"]]
    json.dump(build(request), sys.stdout)
