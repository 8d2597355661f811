package io.pelican.examples.notifications;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;

import io.pelican.worker.Message;
import io.pelican.worker.Outcome;
import java.io.IOException;
import java.util.Map;
import org.junit.jupiter.api.Test;

/** The handler's outcomes, without Redis: what the library then writes is its own tests' business. */
class NotificationsApplicationTest {
    /** Subscriber 404 no longer exists; target 503 finds the provider down. */
    private static final NotificationService SERVICE = new NotificationService() {
        @Override
        public void send(long subscriberId, long targetId, String messageId)
                throws RecipientNotFoundException, IOException {
            if (subscriberId == 404) {
                throw new RecipientNotFoundException();
            }
            if (targetId == 503) {
                throw new IOException("the push provider answered 503");
            }
        }
    };

    private static Message message(String subscriberId, String targetId) {
        return Message.of("1-0", Map.of("subscriberId", subscriberId, "targetId", targetId));
    }

    @Test
    void aSentNotificationIsDone() throws Exception {
        assertEquals(Outcome.done(), NotificationsApplication.handle(SERVICE, message("7", "9")));
    }

    @Test
    void aRecipientThatNoLongerExistsIsTerminal() throws Exception {
        assertEquals(Outcome.terminal("RecipientNotFound"), NotificationsApplication.handle(SERVICE, message("404", "9")));
    }

    @Test
    void aProviderOutageIsAFailureTheWorkerRecordsAndThePolicyRetries() {
        assertThrows(IOException.class, () -> NotificationsApplication.handle(SERVICE, message("7", "503")));
    }
}
